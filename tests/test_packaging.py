"""Packaging: the wheel installs into a fresh virtual environment, and the core never imports Django."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*command: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(folder: Path) -> Path:
    """A wheel built from the source tree into ``folder``. One build at a time per checkout (a lock file): two
    at once, from two test processes, write the same build/ and egg-info folders and fail."""
    import fcntl
    import hashlib

    lock = Path("/tmp") / f"guardrails-build-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run(sys.executable, "-m", "build", "--wheel", "--outdir", folder, ROOT, cwd=folder)
    (built,) = folder.glob("celery_guardrails-*.whl")
    return built


def shared_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the source tree (:func:`build_wheel`) once per run, shared by every test process
    (pytest-xdist's processes share the parent of their temporary folders): each build is an isolated build
    environment of its own, about 15 s of CPU time, and the modules that need a wheel ran on up to four processes."""
    import fcntl
    import os

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "shared-wheel"
    with (root / "shared-wheel.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        ready = folder / "ready"
        if not ready.exists():
            folder.mkdir(exist_ok=True)
            ready.write_text(build_wheel(folder).name)
    return folder / ready.read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the source tree (:func:`shared_wheel`)."""
    return shared_wheel(tmp_path_factory)


def test_wheel_installs_into_a_fresh_venv_and_both_packages_import(tmp_path: Path, wheel: Path) -> None:
    # Given a wheel built from the source tree
    names = zipfile.ZipFile(wheel).namelist()
    for expected in (
        "celery_guardrails/py.typed",
        "django_celery_guardrails/py.typed",
        "django_celery_guardrails/migrations/__init__.py",
        "django_celery_guardrails/apps.py",
    ):
        assert expected in names
    assert not [name for name in names if name.startswith(("tests/", "example_project/", "django_app/"))]
    # And every file of the two packages is in it (the admin's templates, whatever folder holds them: a list of
    # folders once left out the dashboard's, a 500 after a wheel install)
    shipped = {"celery_guardrails": ROOT / "celery_guardrails", "django_celery_guardrails": ROOT / "django_app"}
    missing = sorted(
        f"{package}/{path.relative_to(folder)}"
        for package, folder in shipped.items()
        for path in folder.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix != ".pyc"
        and f"{package}/{path.relative_to(folder)}" not in names
    )
    assert missing == []
    assert "django_celery_guardrails/templates/admin/guardrails/dashboard/dashboard.html" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: celery<5.8,>=5.5.3" in metadata
    assert 'Requires-Dist: Django<6.1,>=4.2; extra == "django"' in metadata
    # When it is installed (without dependencies) into a fresh venv whose dependencies come from this one
    venv = tmp_path / "venv"
    # (No copy of pip set up in it, a few seconds of CPU time: this environment's pip installs into it.)
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python")
    run(*pip, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp_path)
    site = Path(
        run(
            venv / "bin" / "python",
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            cwd=tmp_path,
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Then both packages import from the installed wheel, not from the source tree
    out = run(
        venv / "bin" / "python",
        "-c",
        textwrap.dedent("""
        import celery_guardrails, django_celery_guardrails, django_celery_guardrails.apps
        from celery_guardrails import GuardedTask, tenant_context, current_tenant
        print(celery_guardrails.__file__)
        print(django_celery_guardrails.__file__)
        print(django_celery_guardrails.apps.GuardrailsConfig.label)
    """),
        cwd=tmp_path,
    )
    core, app, label = out.split()
    assert core.startswith(str(site)) and app.startswith(str(site))
    assert label == "guardrails"


def test_core_imports_no_django(tmp_path: Path) -> None:
    # kombu imports django.utils.functional when Django is installed (to serialise lazy strings), so the
    # check is that the core adds no Django module to what Celery itself loads.
    out = run(
        sys.executable,
        "-c",
        textwrap.dedent("""
        import importlib, pkgutil, sys
        import celery, celery.bootsteps, celery.signals, kombu
        django = lambda: {m for m in sys.modules if m == "django" or m.startswith("django.")}
        before = django()
        import celery_guardrails
        for module in pkgutil.walk_packages(celery_guardrails.__path__, "celery_guardrails."):
            importlib.import_module(module.name)
        print(sorted(django() - before))
    """),
        cwd=tmp_path,
    )
    assert out.strip() == "[]"


FRESH_APP = """
import os
from celery import Celery
from celery_guardrails import GuardedTask, tenant_context

url = os.environ["FRESH_REDIS_URL"]
app = Celery("fresh", broker=url, backend=url)
app.conf.task_default_queue = os.environ["FRESH_QUEUE"]
app.conf.guardrails = {"store": url, "dead_letter_sinks": ["redis"]}


@app.task(base=GuardedTask, bind=True, idempotency_key="double:{n}", name="fresh.double")
def double(self, n):
    return {"n": n * 2, "tenant": self.request.get("guardrails", {}).get("tenant")}
"""

FRESH_CLIENT = """
import sys
from fresh import double, tenant_context
with tenant_context("acme"):
    result = double.delay(int(sys.argv[1]))
print(result.get(timeout=60))
"""


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> tuple[Path, Path]:
    """The wheel installed with only the extras the README names for a Django project on Redis, into a fresh
    venv, from the package index (nothing from this environment); the venv and the wheel."""
    folder = tmp_path_factory.mktemp("fresh-venv")
    venv = folder / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=folder)
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[django,redis]", cwd=folder)
    return venv, wheel


# The two tests of the fresh venv (a pip install from the package index, the costliest fixture of the suite) run on
# one test process, which installs it once (make test uses --dist loadgroup). Its set-up is bounded by the test's
# timeout: on a loaded host it took 105 to over 120 s, the suite's bound, so these two have a bound of their own.
@pytest.mark.xdist_group("fresh-venv")
@pytest.mark.timeout(300)
def test_the_documented_extras_are_enough_for_a_guarded_worker_on_redis(
    tmp_path: Path, queue_name: str, fresh_venv: tuple[Path, Path]
) -> None:
    import os
    import signal
    import uuid

    from tests.support.services import REDIS_URL, require

    require("redis")
    # Given the wheel installed with the extras for a Django project on Redis
    venv, _ = fresh_venv
    (tmp_path / "fresh.py").write_text(FRESH_APP)
    (tmp_path / "client.py").write_text(FRESH_CLIENT)
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(tmp_path),
        "FRESH_REDIS_URL": REDIS_URL,
        "FRESH_QUEUE": queue_name,
    }
    # When a worker of a guarded task starts on Redis
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [
                venv / "bin" / "celery",
                "-A",
                "fresh",
                "worker",
                "-P",
                "solo",
                "-l",
                "INFO",
                "-n",
                f"fresh-{uuid.uuid4().hex[:6]}@%h",
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Then a keyed task published with a tenant runs there, and its result comes back
        done = subprocess.run(
            [venv / "bin" / "python", "client.py", "21"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr + log.read_text(errors="replace")
        assert done.stdout.strip() == "{'n': 42, 'tenant': 'acme'}"
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)


KIT_APP = """
import os

import redis
from celery import Celery

from celery_guardrails import GuardedTask

url = os.environ["FRESH_REDIS_URL"]
app = Celery("fresh_kit", broker=url, backend=url)
app.conf.guardrails = {"store": url, "dead_letter_sinks": ["redis"]}
effects = redis.Redis.from_url(url)


@app.task(name="fresh_kit.count_plain", acks_late=True)
def count_plain(key):
    effects.incr("fresh-kit:" + key)


@app.task(base=GuardedTask, bind=True, name="fresh_kit.count_keyed", idempotency_key="count:{key}")
def count_keyed(self, key):
    effects.incr("fresh-kit:" + key)
"""

KIT_TESTS = """
import uuid

import pytest

from celery_guardrails.testing import assert_single_effect, deliver_twice
from fresh_kit import count_keyed, count_plain, effects

pytestmark = pytest.mark.guardrails


def count(key):
    return int(effects.get("fresh-kit:" + key) or 0)


def test_the_plain_task_is_caught():
    key = uuid.uuid4().hex
    deliver_twice(count_plain, key)
    with pytest.raises(AssertionError, match="happened 2 times"):
        assert_single_effect(lambda: count(key))


def test_the_keyed_task_passes():
    key = uuid.uuid4().hex
    report = deliver_twice(count_keyed, key)
    assert report.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    assert_single_effect(lambda: count(key))


def test_the_worker_can_be_killed_and_started(guarded_worker):
    guarded_worker.kill()
    assert not guarded_worker.alive
    guarded_worker.start()
    assert guarded_worker.alive
"""


@pytest.mark.xdist_group("fresh-venv")
@pytest.mark.timeout(300)
def test_the_kit_from_the_wheel_needs_only_the_broker_and_the_store(
    tmp_path: Path, fresh_venv: tuple[Path, Path]
) -> None:
    import os

    from tests.support.services import REDIS_URL, require

    require("redis")
    # Given the wheel's testing extra added (beside pytest-celery, whose plugin loads too: the names do not
    # clash), and a fresh project: an app with its broker URL and store, its tests marked for the kit, and no
    # other set-up (no ini file, no conftest)
    venv, wheel = fresh_venv
    run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        f"{wheel}[redis,testing]",
        "pytest-celery>=1.3,<2",
        cwd=tmp_path,
    )
    project = tmp_path / "project"
    project.mkdir()
    (project / "fresh_kit.py").write_text(KIT_APP)
    (project / "test_fresh_kit.py").write_text(KIT_TESTS)
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "FRESH_REDIS_URL": REDIS_URL, "HOME": str(tmp_path)}

    def pytest_there(*arguments: str) -> subprocess.CompletedProcess[str]:
        command = [venv / "bin" / "python", "-m", "pytest", "-p", "no:cacheprovider", *arguments]
        return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)

    # When its tests run
    done = pytest_there("-q")
    # Then the kit's worker ran them: the plain task was caught, the keyed one passed
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    listed = pytest_there("--fixtures").stdout
    assert "celery_setup" in listed and "guardrails_kit" in listed  # pytest-celery's, and the kit's
