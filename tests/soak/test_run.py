"""The suite's soak (``python -m soak.run --short``): a few hundred jobs of every kind through two real prefork
workers (RabbitMQ) on the Django store with ``atomic=True``, one worker SIGKILLed mid-run, the store (the
database) cut for a few seconds. ``make soak`` runs the long one, with restarts of the broker and PostgreSQL
and both stores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from soak.run import plan_jobs
from tests.support.services import require
from tests.support.workers import ROOT


def test_the_job_plan_has_the_documented_mix() -> None:
    # Given 1,000 logical jobs
    kinds, messages = plan_jobs(1000, seed=1)
    # Then 1% are poison, 2% permanent, 10% transient, the rest ok; 20% of them are published twice
    counts = {kind: list(kinds.values()).count(kind) for kind in ("poison", "permanent", "transient", "ok")}
    assert counts == {"poison": 10, "permanent": 20, "transient": 100, "ok": 870}
    assert len(messages) == 1200 and set(messages) == set(kinds)
    assert sum(1 for job in kinds if messages.count(job) == 2) == 200


@pytest.mark.timeout(600)  # two workers start, one restarts, a database cut; on two shared cores
def test_a_short_soak_loses_nothing_doubles_nothing_and_files_every_dead_letter(tmp_path: Path) -> None:
    require("rabbitmq")
    require("postgres")
    # Given 300 jobs on the Django store (atomic), two prefork workers on RabbitMQ, one SIGKILL and a 5 s
    # database cut (every loss fails)
    command = [sys.executable, "-m", "soak.run", "--short", "--jobs", "300", "--store", "django", "--store-cut", "5"]
    command += ["--broker", "rabbitmq"]
    # When the soak runs them, fixes the permanent failures and replays their dead letters
    done = subprocess.run(
        [*command, "--json", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "[" in done.stdout, done.stdout + done.stderr
    [result] = json.loads(done.stdout[done.stdout.index("\n[") :])
    # Then the chaos happened: one worker killed, the store cut
    assert result["killed"] == 1 and any("store cut" in event for event in result["events"]), result["events"]
    # And no job was lost or doubled, before or after the replay, and every dead letter has the right reason
    for kind, row in result["per_kind"].items():
        assert (kind, row["lost"], row["doubled"], row["misfiled"]) == (kind, 0, 0, 0), result
    assert result["reasons"]["permanent"] == {"permanent": 6} and result["reasons"]["poison"] == {"poison": 3}
    # And nothing is left claimed, the replay added no duplicate, the soak passed
    assert (result["claimed_keys"], result["replay_duplicates"], result["failures"]) == (0, 0, [])
    assert done.returncode == 0, done.stdout[-3000:]
