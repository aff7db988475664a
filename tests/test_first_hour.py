"""The first hour of a new user (#30), as the user goes through it: the documented install (the wheel, not an
editable checkout), then a ``django-admin startproject`` project that follows the README's Quick start as printed.

The Quick start's blocks are read from README.md itself: a fenced block whose first line is ``# <path> (new
file)`` or ``# <path> (add at the end)`` goes into that file; ``# shell: ...`` blocks are commands. What the
tests add of their own (a database and a queue for the run, tasks that fail and then succeed, beat entries) is
written after a marker line, never mixed into the README's text.

One virtual environment serves the whole run (every test process of it): the wheel built once, installed with
the extras the README names, plus ``postgres`` (the tests' database) and ``prometheus`` (the metrics view).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.services import HOST, PORTS, REDIS_URL, require
from tests.support.waiting import wait_for
from tests.test_packaging import ROOT, run, shared_wheel

README = (ROOT / "README.md").read_text()
#: What the tests write into the project's files after the README's text.
OURS = "# --- added by tests/test_first_hour.py, not from the README: "

# One test process runs the module (make test: --dist loadgroup): its tests share the venv fixture, and spread
# over the processes they sat side by side for the one that built it, three processes waiting 42 s each.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("first-hour")]


# ---------------------------------------------------------------------------------------------------- the README


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """A fenced block of the Quick start."""

    language: str  # "python" or "shell"
    target: str  # the file it goes in, or what the shell block is for ("install", "run, ...")
    how: str  # "new file", "add at the end", or "" for shell blocks
    text: str  # the whole block, its first (naming) line included


def quick_start() -> list[Block]:
    """The blocks of README.md's "Quick start for a Django project" section, in order."""
    start = README.index("## Quick start for a Django project")
    section = README[start : README.index("\n---\n", start)]
    found = []
    for language, text in re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.M | re.S):
        first = text.splitlines()[0]
        if language == "python":
            named = re.fullmatch(r"# (\S+) \((new file|add at the end)\)(?::.*)?", first)
            assert named, f"a Quick start python block does not name its file: {first!r}"
            found.append(Block(language=language, target=named[1], how=named[2], text=text))
        else:
            named = re.fullmatch(r"# shell: (.+)", first)
            assert named, f"a Quick start shell block does not say what it is for: {first!r}"
            found.append(Block(language=language, target=named[1], how="", text=text))
    return found


def shell_block(starting: str) -> Block:
    (block,) = [b for b in quick_start() if b.language == "shell" and b.target.startswith(starting)]
    return block


def extras() -> list[str]:
    """The extras of the Quick start's ``pip install`` line."""
    (line,) = [line for line in shell_block("install").text.splitlines() if line.startswith("pip install")]
    match = re.search(r"\[([\w,]+)\]", line)
    assert match, line
    return match[1].split(",")


def commands(block: Block) -> list[list[str]]:
    """The block's commands, each split as a shell would (comments dropped)."""
    return [words for line in block.text.splitlines() if (words := shlex.split(line, comments=True))]


# --------------------------------------------------------------------------------------------- the installation


@dataclass(frozen=True, slots=True, kw_only=True)
class Installed:
    venv: Path
    wheel: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with path.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel, built once and installed (not editable) into a fresh venv with the README's extras, shared by
    every test process of the run (pytest-xdist's processes share the parent of their temporary folders)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "first-hour-venv"
    with locked(root / "first-hour-venv.lock"):
        ready = folder / "ready"
        if not ready.exists():
            folder.mkdir(exist_ok=True)
            wheel = shared_wheel(tmp_path_factory)
            venv = folder / "venv"
            # This environment's pip installs into it (pip --python): no copy of pip to set up there first.
            run("python3", "-m", "venv", "--without-pip", venv, cwd=folder)
            wanted = ",".join([*extras(), "postgres", "prometheus"])
            pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q")
            run(*pip, f"{wheel}[{wanted}]", cwd=folder)
            ready.write_text(str(wheel))
    return Installed(venv=folder / "venv", wheel=Path(ready.read_text()))


@pytest.fixture
def database() -> Iterator[str]:
    """A PostgreSQL database of the test's own, dropped afterwards."""
    require("postgres")
    import psycopg

    name = f"first_hour_{uuid.uuid4().hex[:10]}"
    user = os.environ.get("GUARDRAILS_TEST_PGUSER", "postgres")
    with psycopg.connect(host=HOST, port=PORTS["postgres"], user=user, dbname="postgres", autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(host=HOST, port=PORTS["postgres"], user=user, dbname="postgres", autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def query(database: str, sql: str, *params: object) -> list[tuple[object, ...]]:
    import psycopg

    user = os.environ.get("GUARDRAILS_TEST_PGUSER", "postgres")
    with psycopg.connect(host=HOST, port=PORTS["postgres"], user=user, dbname=database) as db:
        return list(db.execute(sql, params).fetchall())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- the user's project


@dataclass
class Project:
    folder: Path
    env: dict[str, str]
    database: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def manage(self, *arguments: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            ["python", "manage.py", *arguments],
            cwd=self.folder,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check:
            assert done.returncode == 0, f"manage.py {arguments} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def python(self, script: str, *arguments: str) -> str:
        done = subprocess.run(
            ["python", "-c", textwrap.dedent(script), *arguments],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"script failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, command: list[str], log: str) -> Path:
        """Start a long-running command of the Quick start, its output in ``log``; :meth:`stop_all` ends it."""
        path = self.folder / log
        with path.open("wb") as out:
            self.processes.append(
                subprocess.Popen(
                    command,
                    cwd=self.folder,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return path

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            self.stop(process)
        self.processes.clear()


TEST_SETTINGS = (
    OURS
    + """the run's own database and queue, and a beat entry ---
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["FIRST_HOUR_DB"],
        "USER": os.environ.get("GUARDRAILS_TEST_PGUSER", "postgres"),
        "HOST": "127.0.0.1",
    }
}
CELERY_TASK_DEFAULT_QUEUE = os.environ["FIRST_HOUR_QUEUE"]
CELERY_BEAT_SCHEDULE = {"shop-sync-settings": {"task": "shop.tasks.sync", "schedule": 4.0}}
"""
)

TEST_TASKS = (
    OURS
    + """a task that fails permanently until it is fixed, and the beat entries' task ---
import os
from pathlib import Path

from celery_guardrails import PermanentError

FLAGS = Path(os.environ["FIRST_HOUR_FLAGS"])


@shared_task(base=GuardedTask, bind=True, idempotency_key="ship:{order_id}", dependency="carrier-api")
def ship(self, order_id):
    if not (FLAGS / "fixed").exists():
        raise PermanentError(f"order {order_id}: the carrier refused the address")
    (FLAGS / f"shipped-{order_id}").write_text(self.request.id)


@shared_task(base=GuardedTask, idempotent=True)  # a plain task's entry is not watched: check says so (W005)
def sync():
    return "synced"
"""
)


def make_project(tmp_path: Path, installed: Installed, database: str) -> Project:
    """``django-admin startproject proj``, ``startapp shop``, the Quick start's blocks applied as printed, then
    the test's own lines after them; the seal key made by the README's command."""
    require("redis")
    folder = tmp_path / "site"
    folder.mkdir()
    (tmp_path / "flags").mkdir()
    env = {
        "PATH": f"{installed.bin}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "CELERY_BROKER_URL": REDIS_URL,
        "FIRST_HOUR_DB": database,
        "FIRST_HOUR_QUEUE": f"first-hour-{uuid.uuid4().hex[:10]}",
        "FIRST_HOUR_FLAGS": str(tmp_path / "flags"),
    }
    if "GUARDRAILS_TEST_PGUSER" in os.environ:
        env["GUARDRAILS_TEST_PGUSER"] = os.environ["GUARDRAILS_TEST_PGUSER"]
    project = Project(folder=folder, env=env, database=database)
    run(installed.bin / "django-admin", "startproject", "proj", folder, cwd=tmp_path)
    run(installed.bin / "python", "manage.py", "startapp", "shop", cwd=folder)
    for block in quick_start():
        if block.language != "python":
            continue
        path = folder / block.target
        if block.how == "new file":
            path.write_text(block.text)
        else:
            assert path.exists(), f"the Quick start adds to {block.target}, which startproject did not make"
            path.write_text(path.read_text() + "\n\n" + block.text)
    with (folder / "proj" / "settings.py").open("a") as settings:
        settings.write("\n\n" + TEST_SETTINGS)
    with (folder / "shop" / "tasks.py").open("a") as tasks:
        tasks.write("\n\n" + TEST_TASKS)
    key = subprocess.run(
        ["bash", "-c", shell_block("a seal key").text + '\nprintf %s "$GUARDRAILS_SEAL_KEY"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert len(key) == 44, key  # a Fernet key: 32 bytes, url-safe base64
    env["GUARDRAILS_SEAL_KEY"] = key
    return project


def run_block(project: Project) -> tuple[list[list[str]], list[list[str]]]:
    """The "run" block's commands: those that finish (manage.py ...) and the long-running ones (celery ...)."""
    steps = commands(shell_block("run"))
    return [c for c in steps if c[0] == "python"], [c for c in steps if c[0] == "celery"]


REPLAY_FROM_THE_ADMIN = """
import json, os, sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()
from django.test.utils import setup_test_environment

setup_test_environment()  # the test client's host, "testserver", allowed
from celery import current_app
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from django_celery_guardrails.models import DeadLetter

pk = int(sys.argv[1])
imported_before = "shop.tasks" in sys.modules or "shop.tasks.ship" in current_app.tasks
staff = get_user_model().objects.create_superuser("first-hour", "first-hour@example.com", "pw")
client = Client()
client.force_login(staff)
changelist = reverse("admin:guardrails_deadletter_changelist")
asked = client.post(changelist, {"action": "replay_selected", "_selected_action": [pk]})
done = client.post(changelist, {"action": "replay_selected", "_selected_action": [pk], "post": "yes"}, follow=True)
print(json.dumps({
    "imported_before": imported_before,
    "asked": [asked.status_code, "replay these dead letters" in asked.content.decode()],
    "done": done.status_code,
    "messages": [str(m) for m in done.context["messages"]],
    "status": DeadLetter.objects.get(pk=pk).status,
}))
"""


def test_the_quick_start_as_printed_runs_a_guarded_task_and_replays_its_dead_letters(
    tmp_path: Path, installed: Installed, database: str
) -> None:
    # Given a fresh startproject project with the Quick start's blocks from README.md, as printed
    project = make_project(tmp_path, installed, database)
    finishing, long_running = run_block(project)
    assert finishing == [["python", "manage.py", "migrate"], ["python", "manage.py", "check"]]
    assert [c[:4] for c in long_running] == [["celery", "-A", "proj", "worker"], ["celery", "-A", "proj", "beat"]]
    # And without the seal key, `check` names the command that makes one (a hint, not a KeyError)
    unkeyed = {k: v for k, v in project.env.items() if k != "GUARDRAILS_SEAL_KEY"}
    warned = project.manage("check", env=unkeyed)
    assert "guardrails.W002" in warned and "Fernet.generate_key().decode()" in warned, warned
    assert "GUARDRAILS_SEAL_KEY" in warned
    try:
        # When its commands run: migrate and check, then a worker and beat
        for command in finishing:
            out = project.manage(*command[2:])
        assert "guardrails.W002" not in out and "ERROR" not in out, out
        worker_log = project.start(long_running[0], "worker.log")
        project.start(long_running[1], "beat.log")
        wait_for("the worker", lambda: "ready." in worker_log.read_text(errors="replace") or None)
        # And a guarded task that succeeds and one that fails for good are sent
        project.python(
            """
            import os, django
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
            django.setup()
            from shop.tasks import charge, ship
            charge.delay(1, 1999, "tok_visa")
            ship.delay(7)
            ship.delay(8)
            """
        )
        # Then the first succeeds on the worker
        wait_for(
            "the charge",
            lambda: re.search(r"Task shop\.tasks\.charge\[\S+\] succeeded", worker_log.read_text(errors="replace")),
        )
        # And the others are dead letters, open
        sql = "SELECT id, status FROM guardrails_deadletter WHERE task_name = %s ORDER BY id"

        def two_records() -> list[tuple[object, ...]] | None:
            rows = query(database, sql, "shop.tasks.ship")
            return rows if len(rows) == 2 else None

        dead = wait_for("two dead letters", two_records)
        assert [status for _, status in dead] == ["open", "open"]
        (first, _), _ = dead
        # When the cause is fixed and the first is replayed from the admin by a staff user (confirmation, then
        # the replay), in a process that has not imported shop.tasks (autodiscover_tasks() found it, no more)
        (tmp_path / "flags" / "fixed").write_text("")
        replayed = json.loads(project.python(REPLAY_FROM_THE_ADMIN, str(first)))
        # Then the admin asked, then replayed it
        assert replayed == {
            "imported_before": False,
            "asked": [200, True],
            "done": 200,
            "messages": ["Replayed 1 dead letter(s)."],
            "status": "replayed",
        }
        # When the second is replayed by the command
        out = project.manage("guardrails_replay", "--task", "shop.tasks.ship")
        # Then it says so, and both run on the worker and succeed
        assert "Replayed 1 dead letter(s); refused 0." in out, out
        wait_for("both shipped", lambda: all((tmp_path / "flags" / f"shipped-{n}").exists() for n in (7, 8)) or None)
        assert [status for _, status in query(database, sql, "shop.tasks.ship")] == ["replayed", "replayed"]
        log = worker_log.read_text(errors="replace")
        assert len(re.findall(r"Task shop\.tasks\.ship\[\S+\] succeeded", log)) == 2, log
        # And beat, with the Quick start's scheduler, had the settings entry's task run there too
        wait_for(
            "beat's entry",
            lambda: re.search(r"Task shop\.tasks\.sync\[\S+\] succeeded", worker_log.read_text(errors="replace")),
        )
    finally:
        project.stop_all()


def test_the_quick_start_reports_missed_runs_of_settings_entries_and_beat_rows_without_a_policy(
    tmp_path: Path, installed: Installed, database: str
) -> None:
    """#30 point 4: missed-run detection by default, for every beat entry with no ``schedules`` policy written,
    a ``CELERY_BEAT_SCHEDULE`` entry and a django-celery-beat row alike, seen where a person looks (``status``)."""
    # Given the Quick start's project, a settings entry and a django-celery-beat interval row, both every 4 s,
    # and no `schedules` policy written
    project = make_project(tmp_path, installed, database)
    finishing, long_running = run_block(project)
    try:
        for command in finishing:
            project.manage(*command[2:])
        project.python(
            """
            import os, django
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
            django.setup()
            from django_celery_beat.models import IntervalSchedule, PeriodicTask
            every = IntervalSchedule.objects.create(every=4, period=IntervalSchedule.SECONDS)
            PeriodicTask.objects.create(name="shop-sync-row", task="shop.tasks.sync", interval=every)
            """
        )
        project.start(long_running[0], "worker.log")
        beat = project.start(long_running[1], "beat.log")
        # When beat runs about 10 s, then stops for about 15 s
        wait_for(
            "beat's first dispatches",
            lambda: (
                all(name in beat.read_text(errors="replace") for name in ("shop-sync-settings", "shop-sync-row"))
                or None
            ),
            timeout=30,
        )
        time.sleep(6)  # beat's own period: nothing to wait for but the clock
        project.stop(project.processes[1])
        time.sleep(15)  # the runs beat does not dispatch while it is stopped
        # Then the watchdog (the command, or the worker's own, whichever checked first) records missed runs of
        # both in the ledger, and the command names those it recorded itself, at a moment as people read it
        out = project.manage("guardrails_watchdog")
        sql = "SELECT DISTINCT schedule FROM guardrails_scheduledrun WHERE status = 'missed' AND schedule = %s"
        for name in ("shop-sync-settings", "shop-sync-row"):
            assert query(database, sql, name), out
        for line in re.findall(r"^missed: .*$", out, flags=re.M):
            assert re.fullmatch(r"missed: shop-sync-(settings|row) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", line), out
        # And `celery -A proj guardrails status` reports the missed runs of both, as text and as JSON
        status = subprocess.run(
            ["celery", "-A", "proj", "guardrails", "status", "--json"],
            cwd=project.folder,
            env=project.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        schedules = {s["schedule"]: s for s in json.loads(status.stdout)["schedules"]}
        for name in ("shop-sync-settings", "shop-sync-row"):
            assert name in schedules and schedules[name]["missed"] >= 1, schedules
        text = subprocess.run(
            ["celery", "-A", "proj", "guardrails", "status"],
            cwd=project.folder,
            env=project.env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        for name in ("shop-sync-settings", "shop-sync-row"):
            (row,) = re.findall(rf"^  {name} .*$", text, flags=re.M)
            _, _, _, missed, _ = row.split()  # SCHEDULE, LAST RECORD, LAST SUCCESS, MISSED 1D, OVERDUE
            assert int(missed) >= 1, text
    finally:
        project.stop_all()


RENDER_EVERY_PAGE = """
import json, os, re, sys, uuid

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()
from django.test.utils import setup_test_environment

setup_test_environment()  # the test client's host, "testserver", allowed
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.staticfiles import finders
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

import django_celery_guardrails
from django_celery_guardrails.bulk import ACTIONS
from django_celery_guardrails.models import (
    ConcurrencySlot, DeadLetter, DependencyState, IdempotencyKey, Job, OutboxMessage, ScheduledRun, WaitingMessage,
)

imported_before = "shop.tasks" in sys.modules
now = timezone.now()
later = now + timezone.timedelta(minutes=10)
# One row of each table the admin registers, as the workers write them, so every record's page renders too.
DeadLetter.objects.create(
    task_name="shop.tasks.charge", task_id=str(uuid.uuid4()), args=[1], kwargs={"amount_cents": 1999},
    reason="permanent", exc_type="ValueError", exc_message="card declined", first_failed_at=now, last_failed_at=now,
)
ScheduledRun.objects.create(schedule="shop-sync", period=now, status="ok")
IdempotencyKey.objects.create(key="shop.tasks.charge::charge:1", state="completed", summary="None", finished_at=now)
ConcurrencySlot.objects.create(
    key="shop.tasks.charge:acme:pdf", holder="worker-1:4242:" + str(uuid.uuid4()), task_name="shop.tasks.charge",
    task_id=str(uuid.uuid4()), tenant="acme", acquired_at=now, heartbeat_at=now,
)
OutboxMessage.objects.create(
    task_name="shop.tasks.charge", task_id=str(uuid.uuid4()), body='[[2, 500, "tok_visa"], {}]', available_at=now,
)
DependencyState.objects.create(dependency="payments-api", circuit="open", failures=3, open_until=later.timestamp())
waiting = WaitingMessage.objects.create(
    task_id=str(uuid.uuid4()), task_name="shop.tasks.charge", tenant="acme", reason="circuit", detail="payments-api",
    attempt=2, due_at=later, since=now, expires_at=later + timezone.timedelta(days=1),
)
job = Job(task_name="shop.tasks.charge", task_id=str(uuid.uuid4()), created_at=now, updated_at=now)
job.record("queued", attempt=0, detail="submitted", now=now)
job.save(force_insert=True)
staff = get_user_model().objects.create_superuser("first-hour", "first-hour@example.com", "pw")
asking = RequestFactory().get("/")
asking.user = staff
client = Client()
client.force_login(staff)
# The metrics first: the admin's dead-letter pages import the task modules too (a replay's outlook).
pages = [reverse("guardrails:metrics"), reverse("admin:index")]
pages.append(reverse("admin:app_list", kwargs={"app_label": "guardrails"}))
without_record = []
for model, model_admin in admin.site._registry.items():
    if model._meta.app_label != "guardrails":
        continue
    record = model._default_manager.order_by("pk").first()
    for pattern in model_admin.get_urls():
        name = pattern.name or ""
        if not name.startswith("guardrails_"):
            continue
        if name.endswith("_add") and not model_admin.has_add_permission(asking):
            continue
        if name.endswith("_delete") and not model_admin.has_delete_permission(asking, record):
            continue
        if name.endswith(("_change", "_history")) and not model_admin.has_view_or_change_permission(asking, record):
            continue
        parameters = list(getattr(pattern.pattern, "converters", {}))
        if name == "guardrails_deadletter_bulk":  # an action, not a record: the list's "all matching" pages
            pages += [reverse("admin:" + name, args=[action]) + "?reason=permanent" for action in ACTIONS]
        elif not parameters:
            pages.append(reverse("admin:" + name))
        elif record is None:
            without_record.append(name)
        else:
            pages.append(reverse("admin:" + name, args=[record.pk]))
rendered, statics, metrics, waiting_listed = {}, set(), "", False
for url in pages:
    try:
        response = client.get(url)
    except Exception as exc:  # TemplateDoesNotExist and the like: the test client raises the view's error
        rendered[url] = f"{type(exc).__name__}: {exc}"
        continue
    rendered[url] = response.status_code
    body = response.content.decode()
    if url.endswith("metrics"):
        metrics = body
    if url == reverse("admin:guardrails_waitingmessage_changelist"):
        waiting_listed = waiting.task_id in body and "circuit payments-api" in body
    statics.update(re.findall(r'(?:src|href)="/static/([^"?#]+)', body))
missing_statics = sorted(path for path in statics if not finders.find(path))
print(json.dumps({
    "imported_before": imported_before,
    "job": str(job.pk),
    "package": os.path.dirname(django_celery_guardrails.__file__),
    "rendered": rendered,
    "without_record": without_record,
    "waiting_listed": waiting_listed,
    "statics": sorted(statics),
    "missing_statics": missing_statics,
    "dependencies": sorted(set(re.findall(r'dependency="([^"]+)"', metrics))),
}))
"""


def test_every_admin_page_and_the_metrics_render_from_the_installed_wheel(
    tmp_path: Path, installed: Installed, database: str
) -> None:
    # Given the wheel installed (not editable) with the documented extras, in the Quick start's project, one row of
    # every table the guardrails admin registers (a dead letter, a ledger record, an idempotency key, a concurrency
    # slot, an outbox message, a dependency's state, a waiting message) in its database
    project = make_project(tmp_path, installed, database)
    project.manage("migrate")
    # When a staff user opens every page of the guardrails admin (the index, the app's index, each change list,
    # each record's pages, the health page, the dashboard, the overview) and the metrics view
    seen = json.loads(project.python(RENDER_EVERY_PAGE))
    # Then the package served them from the venv, not from the source tree
    assert seen["package"].startswith(str(installed.venv)), seen["package"]
    # And every one is a 200: no TemplateDoesNotExist, no 500; no page with a record's id was left out for want
    # of a record
    assert {url: status for url, status in seen["rendered"].items() if status != 200} == {}
    assert seen["without_record"] == []
    rendered = list(seen["rendered"])
    for table in ("idempotencykey", "concurrencyslot", "outboxmessage", "dependencystate", "waitingmessage"):
        for page in ("", "1/change/", "1/history/"):
            assert f"/admin/guardrails/{table}/{page}" in rendered, (table, page, rendered)
    # And the Waiting page lists the waiting message, with its reason
    assert seen["waiting_listed"] is True
    for page in (
        "/admin/guardrails/",
        "/admin/guardrails/deadletter/",
        "/admin/guardrails/deadletter/1/change/",
        "/admin/guardrails/deadletter/1/replay/",
        "/admin/guardrails/deadletter/overview/",
        "/admin/guardrails/deadletter/bulk/replay/?reason=permanent",
        "/admin/guardrails/dashboard/",
        "/admin/guardrails/scheduledrun/",
        "/admin/guardrails/scheduledrun/1/change/",
        "/admin/guardrails/scheduledrun/health/",
        "/admin/guardrails/job/",
        f"/admin/guardrails/job/{seen['job']}/change/",
        "/guardrails/metrics",
    ):
        assert page in rendered, rendered
    # And every static file the pages reference is there
    assert seen["statics"] and seen["missing_statics"] == []
    # And the metrics have the gauges of the guarded task's dependency, although nothing in the web process
    # imported shop.tasks (autodiscover_tasks() found it; the view imported it as a worker does)
    assert seen["imported_before"] is False
    assert seen["dependencies"] == ["carrier-api", "payments-api"]


@pytest.mark.django_db
def test_a_task_module_that_fails_to_import_is_named_in_the_refusal_and_warned_once() -> None:
    import logging

    from celery import Celery
    from django.utils import timezone

    from django_celery_guardrails.models import DeadLetter
    from django_celery_guardrails.replay import replay_dead_letters

    # Given a project whose task module raises when imported, and an open dead letter of a task it defines
    app = Celery(f"broken-{uuid.uuid4().hex[:6]}", broker=REDIS_URL, set_as_current=False)
    app.conf.imports = ("tests.support.broken_tasks",)
    now = timezone.now()
    record = DeadLetter.objects.create(
        task_name="shop.tasks.charge",
        task_id=str(uuid.uuid4()),
        args=[1],
        kwargs={},
        reason="permanent",
        first_failed_at=now,
        last_failed_at=now,
    )
    # When it is replayed, twice (the warnings heard on the module's logger itself: Celery's Django fixup runs
    # django.setup() before the import, whose logging set-up closes pytest's capturing handler)
    warned: list[str] = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("django_celery_guardrails.discovery")
    logger.addHandler(heard)
    try:
        results = [replay_dead_letters([record.pk], app=app) for _ in range(2)]
    finally:
        logger.removeHandler(heard)
    # Then each refusal names the module and its error, and the record stays open
    why = (
        "task 'shop.tasks.charge' is not registered in this process (not found by autodiscover_tasks, CELERY_IMPORTS "
        "or include); importing the task module 'tests.support.broken_tasks' failed: RuntimeError: the settings "
        "lack PAYMENTS_URL; the record stays open"
    )
    assert [(result.replayed, result.skipped) for result in results] == [([], [(record.pk, why)])] * 2
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    # And the process tried the import once, and warned once
    assert warned == [
        "Tasks cannot be looked up in this process: importing the task module 'tests.support.broken_tasks' "
        "failed: RuntimeError: the settings lack PAYMENTS_URL"
    ]


# ------------------------------------------------------------------------------------ the documentation's blocks

#: The names the documentation's task blocks leave to the project (its models, its clients, its errors):
#: stand-ins of the user's own code, so that each block imports as the page prints it.
STANDINS = (
    OURS
    + """the project's own names the pages' blocks use ---
from types import SimpleNamespace

from celery import shared_task

from celery_guardrails import GuardedTask


class InvalidAmount(ValueError):
    pass


Charge = Order = SimpleNamespace(objects=None)
payments = carrier = SimpleNamespace(charge=None, book=None)


def notify(order):
    return None
"""
)

IMPORT_THE_DOCS_TASKS = """
import importlib, json, os, sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
django.setup()
from celery import current_app

current_app.conf.task_always_eager = True  # no worker: a block's own calls run in this process
current_app.conf.task_eager_propagates = True
seen = {}
charge = sys.argv[1]  # the test kit page's block that defines charge_order
for module in sys.argv[2:]:
    loaded = importlib.import_module(module)
    tasks = {name: task for name, task in current_app.tasks.items() if name.startswith(module + ".")}
    seen[module] = {name: hasattr(task, "guardrails") for name, task in tasks.items()}
# The blocks whose bodies need nothing of the project's: called, eagerly, through the guardrails
ran = {}
for name, args in [("index_24.send_receipt", (42,)), (charge + ".charge_order", (7, 1999))]:
    task = current_app.tasks["shop.docs_" + name]
    from celery_guardrails import tenant_context

    with tenant_context("acme"):
        ran[name] = task.delay(*args).status  # eager: run here, through the guardrails, as published
print(json.dumps({"seen": seen, "ran": ran}))
"""


def docs_blocks() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The documentation pages' Python blocks a project would paste: settings blocks (they assign upper-case
    settings) and task blocks (they define a ``@shared_task``), each as (a module-friendly name, its text)."""
    from tests.test_docs import PYTHON

    settings, tasks = [], []
    for block in PYTHON:
        if block.source == "README.md":
            continue  # the Quick start: the tests above run it
        name = re.sub(r"\W", "_", block.source.rsplit("/", 1)[1].removesuffix(".md")) + f"_{block.line}"
        if "@shared_task" in block.text:
            tasks.append((name, block.text))
        elif re.search(r"^(CELERY_\w+|LOGGING|INSTALLED_APPS|MIDDLEWARE) *\+?=", block.text, flags=re.M):
            settings.append((name, block.text))
    return settings, tasks


def test_the_docs_settings_and_task_blocks_run_in_the_quick_start_s_project(
    tmp_path: Path, installed: Installed, database: str
) -> None:
    # Given the Quick start's project, and the documentation pages' settings and task blocks
    project = make_project(tmp_path, installed, database)
    settings, tasks = docs_blocks()
    assert {name for name, _ in settings} >= {"context_40", "context_58", "scheduled_work_7"}
    # (the test kit page's keyed charge_order, wherever the page has it)
    charge = next(name for name, text in tasks if name.startswith("testing_") and 'idempotency_key="charge:' in text)
    assert {name for name, _ in tasks} >= {"index_24", "idempotency_3", "retries_72", charge}
    project.manage("migrate")
    # (the project's own names: the tenant resolver a settings block names, the task a beat entry names)
    (project.folder / "myproject").mkdir()
    (project.folder / "myproject" / "__init__.py").write_text("")
    (project.folder / "myproject" / "tenants.py").write_text(OURS + "---\ndef tenant_of(request):\n    return None\n")
    with (project.folder / "shop" / "tasks.py").open("a") as shop:
        shop.write(f"\n\n{OURS}a scheduled-work page's entry ---\n")
        shop.write("@shared_task(base=GuardedTask, bind=True, idempotent=True)\ndef settle_payments(self):\n")
        shop.write("    return self.request.since\n")
    # When each settings block is added to the project's settings, and `manage.py check` runs on them
    for name, text in settings:
        module = project.folder / "proj" / f"docs_{name}.py"
        module.write_text(
            "from proj.settings import *  # noqa: F403\n\n"
            + text
            + f"\n\n{OURS}an app or middleware the Quick start added already, once ---\n"
            + "INSTALLED_APPS = list(dict.fromkeys(INSTALLED_APPS))\nMIDDLEWARE = list(dict.fromkeys(MIDDLEWARE))\n"
        )
        out = project.manage("check", "--settings", f"proj.docs_{name}", check=False)
        # Then each is a project Django and the guardrails accept: no error
        assert "System check identified" in out or "no issues" in out, (name, out)
        assert "ERRORS:" not in out and "guardrails.E" not in out and "Traceback" not in out, (name, out)
    # When each task block is a module of the shop app, imported by the web process
    for name, text in tasks:
        (project.folder / "shop" / f"docs_{name}.py").write_text(STANDINS + "\n\n" + text)
    seen = json.loads(project.python(IMPORT_THE_DOCS_TASKS, charge, *(f"shop.docs_{name}" for name, _ in tasks)))
    # Then each registers its tasks, a GuardedTask where the block says base=GuardedTask
    for name, text in tasks:
        registered = seen["seen"][f"shop.docs_{name}"]
        assert registered, (name, seen)
        assert all(registered.values()) == ("base=GuardedTask" in text), (name, registered)
    # And the blocks whose bodies need nothing of the project's run through the guardrails (eagerly)
    assert seen["ran"] == {"index_24.send_receipt": "SUCCESS", f"{charge}.charge_order": "SUCCESS"}
