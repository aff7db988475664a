"""Celery apps for the audit's tests: one with every planted finding, one with none.

``bad_app()`` and ``good_app()`` make a fresh app each (``set_as_current=False``: no other test sees it). The
module's ``bad`` and ``good`` are for ``celery -A tests.support.audit_apps:bad guardrails audit`` in a
subprocess. Nothing here talks to the broker: the audit reads configuration only.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.schedules import crontab
from cryptography.fernet import Fernet

from celery_guardrails import GuardedTask

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
    ("GA301", "bad.unsafe"),  # the retry_unsafe opt-out, listed
    ("GA302", "bad.early"),  # acks_late off
    ("GA303", "bad.plain_late"),  # acks_late without reject_on_worker_lost
    ("GA304", "bad.slow"),  # time_limit without soft_time_limit
    ("GA401", "bad.keyless"),  # no owner
    ("GA402", "alert_channels"),  # only "log"
    ("GA405", "seal_keys"),  # no seal_keys
    ("GA501", "bad.slow"),  # backoff_max, retry_later and time_limit (lease off) over a 300 s visibility_timeout
    ("GA502", "worker_prefetch_multiplier"),  # 4, with tasks without a time_limit
    ("GA503", "bad.ordered"),  # ordering_key without idempotency_key
    ("GA601", "nightly"),  # a beat entry without a policy
    ("GA602", "hourly"),  # a crontab policy without timezone
    ("GA603", "hourly"),  # ... and without an owner, on an unowned task
    ("GA605", "plain-sync"),  # a policy for a plain task's entry
    ("GA606", "watchdog"),  # the watchdog off
    ("GA701", "metrics"),  # metrics off
    ("GA702", "activity"),  # activity off
}


def own_tasks(app: Celery, prefix: str) -> Celery:
    """Keep only the app's own tasks (and Celery's): every ``shared_task`` imported in this process (the
    example project's, the suite's) is added to every app as it is finalised, and would be graded too. The app's
    default modules are imported first, as the audit imports them (with DJANGO_SETTINGS_MODULE set, Celery's
    Django fixup brings the project's tasks in then)."""
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

    @app.task(shared=False, name="bad.report", base=GuardedTask, bind=True, owner="ops")
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
    def charge(self: Any, order_id: int) -> None: ...

    @app.task(shared=False, name="good.settle", base=GuardedTask, bind=True)
    def settle(self: Any) -> None: ...

    return own_tasks(app, "good.")


bad = bad_app()
good = good_app()
