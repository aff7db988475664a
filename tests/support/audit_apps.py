"""Celery apps for the audit's tests: one with every planted finding, one with none, the tasks of issue #27.

``bad_app()``, ``good_app()`` and ``issue27_app()`` make a fresh app each (``set_as_current=False``: no other test
sees it). The module's ``bad``, ``good`` and ``issue27`` are for ``celery -A tests.support.audit_apps:bad
guardrails audit`` in a subprocess. Nothing here talks to the broker, and no task here is ever run: the audit
reads configuration, options and code only. The source the audit reads with them is a folder the test writes
(``write_tree``): the bad app's is empty (no test uses the kit), the good app's is ``good_tree()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery import Celery
from celery.schedules import crontab
from cryptography.fernet import Fernet

from celery_guardrails import GuardedTask
from tests.support.issue27 import ISSUE27_RETRIES, add_issue27_tasks, post

__all__ = [
    "BROKER",
    "ISSUE27_RETRIES",
    "PLANTED",
    "bad",
    "bad_app",
    "good",
    "good_app",
    "good_tree",
    "issue27",
    "issue27_app",
    "kit_test",
    "own_tasks",
    "write_tree",
]

#: The rubric's nine axes, in its order, as the audit must report them.
AXES = [
    "placement",
    "message_design",
    "idempotency",
    "retry_policy",
    "dead_letters",
    "ordering_concurrency",
    "scheduled_work",
    "observability",
    "tests",
]

#: The broker named in the apps' config (never connected to).
BROKER = "redis://127.0.0.1:6379/15"

#: What ``bad_app()`` plants: every (code, subject) the audit must report for it.
PLANTED = {
    ("GA101", "bad.plain"),  # a plain Celery task
    ("GA101", "bad.plain_late"),
    ("GA102", "max_payload_bytes"),  # max_payload_bytes 0
    ("GA103", "bad.secret"),  # allow_sensitive_payload, listed
    ("GA104", "sensitive_keys"),  # sensitive_keys emptied
    ("GA105", "bad.versions"),  # accepts_versions without its own payload_version
    ("GA201", "bad.unsafe"),  # retry_unsafe without a key
    ("GA201", "bad.keyless"),  # idempotent without a key
    ("GA202", "bad.slow"),  # keyed, but its body never hands the key on (nor atomic, nor marked)
    ("GA203", "bad.report"),  # atomic=True without a key: no transaction at all
    ("GA301", "bad.unsafe"),  # retry_unsafe: the zero rule
    ("GA302", "bad.early"),  # acks_late off
    ("GA303", "bad.plain_late"),  # acks_late without reject_on_worker_lost
    ("GA304", "bad.slow"),  # time_limit without soft_time_limit
    *(("GA309", f"bad.{name}") for name in ("early", "ordered", "report", "secret", "versions")),  # never retried
    ("GA401", "bad.keyless"),  # no owner
    ("GA402", "alert_channels"),  # only "log"
    ("GA405", "seal_keys"),  # no seal_keys
    ("GA501", "bad.slow"),  # backoff_max, retry_later and time_limit (lease off) over a 300 s visibility_timeout
    ("GA502", "worker_prefetch_multiplier"),  # 4, with tasks without a time_limit
    ("GA503", "bad.ordered"),  # ordering_key without idempotency_key
    ("GA601", "plain-nightly"),  # a beat entry without a policy, not watched: its task is a plain one
    ("GA607", "nightly"),  # a beat entry without a policy: watched with the default policy
    ("GA602", "hourly"),  # a crontab policy without timezone
    ("GA603", "hourly"),  # ... and without an owner, on an unowned task
    ("GA605", "plain-sync"),  # a policy for a plain task's entry
    ("GA606", "watchdog"),  # the watchdog off
    ("GA701", "metrics"),  # metrics off
    ("GA702", "activity"),  # activity off
    ("GA801", "tests"),  # its source (an empty folder) has no test that uses the kit
    *(  # ... so no guarded task is named in one
        ("GA802", f"bad.{name}")
        for name in ("early", "keyless", "ordered", "report", "secret", "slow", "unsafe", "versions")
    ),
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (relative path: text) below ``root``, for the audit to read as a project's source."""
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def kit_test(*names: str) -> str:
    """A test module that uses the test kit and names ``names`` (never run: the audit only parses it)."""
    calls = "".join(f"    deliver_twice({name}, 1)\n" for name in names)
    return (
        "import pytest\n"
        "from celery_guardrails.testing import assert_no_loss, deliver_twice\n\n"
        'pytestmark = pytest.mark.guardrails(app="proj.celery:app")\n\n\n'
        f"def test_each_task_once() -> None:\n{calls}    assert_no_loss()\n"
    )


def good_tree(root: Path) -> Path:
    """The good app's source: one test that uses the kit, naming both its tasks."""
    return write_tree(root, {"tests/test_good.py": kit_test("charge", "settle")})


def own_tasks(app: Celery, prefix: str) -> Celery:
    """Keep only the app's own tasks (and Celery's): every ``shared_task`` imported in this process (the
    example project's, the suite's) is added to every app as it is finalised, and would be graded too. The app's
    default modules are imported first, as the audit imports them (with DJANGO_SETTINGS_MODULE set, Celery's
    Django fixup brings the project's tasks in then).

    Each keeps its database connections across tasks (``CELERY_DB_REUSE_MAX``, unless it says otherwise): in the
    suite's process the store is the Django database, on PostgreSQL in one pass and SQLite in the other, so the
    connection rule (GA006) would be found in one and not the other. Its own tests give it the database it reads
    (tests/django_app/test_checks.py)."""
    if app.conf.get("CELERY_DB_REUSE_MAX") is None:
        app.conf["CELERY_DB_REUSE_MAX"] = 1000
    app.loader.import_default_modules()
    for name in list(app.tasks):
        if not name.startswith((prefix, "celery.")):
            del app.tasks[name]
    return app


def bad_app() -> Celery:
    app = Celery("bad", set_as_current=False)
    app.conf.update(
        broker_url=BROKER,
        broker_transport_options={"visibility_timeout": 300},
        worker_prefetch_multiplier=4,
        beat_schedule={
            "nightly": {"task": "bad.report", "schedule": crontab(hour=2, minute=30)},
            "hourly": {"task": "bad.keyless", "schedule": crontab(minute=0)},
            "plain-sync": {"task": "bad.plain", "schedule": 3600.0},
            "plain-nightly": {"task": "bad.plain", "schedule": 86400.0},
        },
        guardrails={
            "alert_channels": ["log"],
            "max_payload_bytes": 0,
            "sensitive_keys": [],
            "metrics": False,
            "activity": False,
            "broker_lease": False,
            "watchdog": False,
            "backoff_max": 60,
            "schedules": {"hourly": {}, "plain-sync": {"timezone": "UTC", "owner": "ops"}},
        },
    )

    @app.task(shared=False, name="bad.plain")
    def plain() -> None: ...

    @app.task(shared=False, name="bad.plain_late", acks_late=True, reject_on_worker_lost=False)
    def plain_late() -> None: ...

    @app.task(shared=False, name="bad.unsafe", base=GuardedTask, bind=True, retry_unsafe=True, owner="ops")
    def unsafe(self: Any) -> None: ...

    @app.task(shared=False, name="bad.keyless", base=GuardedTask, bind=True, idempotent=True)
    def keyless(self: Any) -> None: ...

    @app.task(
        shared=False,
        name="bad.slow",
        base=GuardedTask,
        bind=True,
        owner="ops",
        idempotency_key="slow:{n}",
        backoff_max=900,
        retry_later_delay=60,
        time_limit=600,
    )
    def slow(self: Any, n: int) -> None: ...

    @app.task(shared=False, name="bad.early", base=GuardedTask, bind=True, owner="ops", acks_late=False)
    def early(self: Any) -> None: ...

    @app.task(
        shared=False,
        name="bad.secret",
        base=GuardedTask,
        bind=True,
        owner="ops",
        allow_sensitive_payload="the legacy directory takes the raw password",
    )
    def secret(self: Any, password: str) -> None: ...

    @app.task(
        shared=False, name="bad.ordered", base=GuardedTask, bind=True, owner="ops", ordering_key="account:{account}"
    )
    def ordered(self: Any, account: int) -> None: ...

    @app.task(
        shared=False,
        name="bad.versions",
        base=GuardedTask,
        bind=True,
        owner="ops",
        payload_version=2,
        accepts_versions=(1,),
    )
    def versions(self: Any) -> None: ...

    @app.task(shared=False, name="bad.report", base=GuardedTask, bind=True, owner="ops", atomic=True)
    def report(self: Any) -> None: ...

    return own_tasks(app, "bad.")


def good_app() -> Celery:
    app = Celery("good", set_as_current=False)
    app.conf.update(
        broker_url=BROKER,
        worker_prefetch_multiplier=1,
        beat_schedule={"settle": {"task": "good.settle", "schedule": crontab(minute="*/5")}},
        guardrails={
            "owners": {"good.*": "shop"},
            "alert_channels": ["log", "webhook"],
            "alert_webhooks": ["http://127.0.0.1:9/alerts"],
            "seal_keys": [Fernet.generate_key().decode()],
            "metrics": True,
            "schedules": {"settle": {"timezone": "Europe/Berlin", "owner": "shop"}},
        },
    )

    @app.task(shared=False, name="good.charge", base=GuardedTask, bind=True, idempotency_key="charge:{order_id}")
    def charge(self: Any, order_id: int) -> None:
        post(f"http://127.0.0.1:9/charges/{order_id}", key=self.request.idempotency_key)

    @app.task(shared=False, name="good.settle", base=GuardedTask, bind=True)
    def settle(self: Any) -> None:
        with self.effect():
            post("http://127.0.0.1:9/settlements")

    return own_tasks(app, "good.")


def issue27_app(*, plain: bool = True, unsafe: bool = True) -> Celery:
    """The tasks of issue #27 in an app configured as the good one is: what is found is the tasks'."""
    app = Celery("issue27", set_as_current=False)
    app.conf.update(
        broker_url=BROKER,
        worker_prefetch_multiplier=1,
        guardrails={
            "owners": {"issue27.*": "shop"},
            "alert_channels": ["log", "webhook"],
            "alert_webhooks": ["http://127.0.0.1:9/alerts"],
            "seal_keys": [Fernet.generate_key().decode()],
            "metrics": True,
        },
    )
    return own_tasks(add_issue27_tasks(app, plain=plain, unsafe=unsafe), "issue27.")


bad = bad_app()
good = good_app()
issue27 = issue27_app()
