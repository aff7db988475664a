"""The suite's fork server (tests/support/zygote.py): a child it starts is the process ``python -m`` would have
been, as the tests that start, signal and SIGKILL workers rely on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import zygote
from tests.support.workers import ROOT

PRINT_ITSELF = "tests.support.print_process"


def run_printer(tmp_path: Path, *, forked: bool, flag: str) -> dict[str, object]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "GUARDRAILS_FORK_PROBE": "probe",
    }
    target = PRINT_ITSELF if flag == "-m" else f"from {PRINT_ITSELF} import main; main()"
    command = [sys.executable, flag, target, "an argument"]
    if forked:
        done = zygote.run(command, cwd=tmp_path, env=env, timeout=30)
    else:
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done.stderr
    assert done.stderr == "to stderr\n"
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize("flag", ["-m", "-c"])
def test_a_child_sees_what_python_m_or_c_would_have_given_it(tmp_path: Path, flag: str) -> None:
    # Given the fork server of this test process
    server = zygote.server()
    # When a module (or code) is run through it with a variable, a working directory and a PYTHONPATH of its own, and
    # again as a plain `python -m` subprocess
    forked = run_printer(tmp_path, forked=True, flag=flag)
    plain = run_printer(tmp_path, forked=False, flag=flag)
    # Then the child saw the same argv, environment, directory, import path and signal dispositions, with
    # Django's settings not configured, in a session of its own under the server
    assert forked["probe"] == "probe"
    assert {name: forked[name] for name in plain if name not in ("pid", "sid", "parent")} == {
        name: plain[name] for name in plain if name not in ("pid", "sid", "parent")
    }
    assert forked["sid"] == forked["pid"] != os.getsid(0)
    assert forked["parent"] == server._server.pid
    assert forked["settings_configured"] is False


def test_a_sigkilled_group_reports_minus_nine_as_popen_does(tmp_path: Path) -> None:
    # Given a child that sleeps, with a grandchild in its process group
    log = tmp_path / "log"
    with log.open("wb") as out:
        process = zygote.server().start(
            [sys.executable, "-m", "tests.support.print_process", "--sleep"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            log_fd=out.fileno(),
        )
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.5)
    assert process.poll() is None
    # When its process group is SIGKILLed, as the tests kill a worker
    os.killpg(process.pid, signal.SIGKILL)
    # Then its exit status is -9, as subprocess.Popen reports a signal
    assert process.wait(10) == -signal.SIGKILL


def test_a_variable_read_at_import_is_not_forked() -> None:
    # Given the server, started without PROMETHEUS_MULTIPROC_DIR and with this interpreter's PYTHON* variables
    server = zygote.server()
    # Then an environment that sets the variable, or another PYTHON* value, is run as a plain subprocess
    assert server.can_fork({**os.environ})
    assert not server.can_fork({**os.environ, "PROMETHEUS_MULTIPROC_DIR": "/tmp/x"})
    assert not server.can_fork({**os.environ, "PYTHONHASHSEED": "7"})
    # And only this interpreter's `-m` and `-c` are forkable
    assert zygote.forkable([sys.executable, "-c", "pass"])
    assert not zygote.forkable([sys.executable, "script.py"])
    assert not zygote.forkable(["python3", "-m", "celery"])
