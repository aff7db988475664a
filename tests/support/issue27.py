"""The tasks of issue #27, for the audit's tests: ``add_issue27_tasks(app)`` puts them on an app.

Imported by :mod:`tests.support.audit_apps` (a Celery app of their own) and by the Django audit tests' settings
(the example project's app with them, in a ``manage.py`` subprocess). No module-level app: importing this
registers nothing. The tasks are never run: the audit reads their options and code.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from celery import Celery

from celery_guardrails import GuardedTask


def post(url: str, *, key: str | None = None) -> None:
    """What the tasks below would do to a provider (never called: the audit does not run them)."""
    headers = {"Idempotency-Key": key} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, method="POST", headers=headers), timeout=5):
        pass


#: What ``issue27_app()`` is audited to, per (code, subject), besides its message-design and test findings.
ISSUE27_RETRIES = {
    ("GA201", "issue27.unsafe"),  # retry_unsafe without a key
    ("GA202", "issue27.keyed_not_handed"),  # keyed, the key never handed to the provider
    ("GA301", "issue27.unsafe"),  # the zero rule
    ("GA305", "issue27.plain"),  # a plain task with autoretry_for and max_retries: the zero rule
    ("GA306", "issue27.plain"),  # ... at a fixed interval (default_retry_delay 5 s, no retry_backoff)
    ("GA307", "issue27.autoretried"),  # autoretry_for=(Exception,) on a GuardedTask
    ("GA308", "issue27.plain"),  # 20 retries
    ("GA309", "issue27.charge_then_notify"),  # marks no effect: the gate never retries it
    ("GA309", "issue27.autoretried"),
    ("GA309", "issue27.asks_again"),
    ("GA309", "issue27.invalid"),
}


def add_issue27_tasks(app: Celery, *, plain: bool = True, unsafe: bool = True) -> Celery:
    """The tasks of issue #27 (``plain``: with the plain task retried 20 times at a fixed interval; ``unsafe``:
    with the retry_unsafe one), on ``app``."""

    @app.task(shared=False, name="issue27.charge_then_notify", base=GuardedTask, bind=True)
    def charge_then_notify(self: Any, order_id: int) -> None:
        post(f"http://127.0.0.1:9/charges/{order_id}")  # acts (not marked), then
        post(f"http://127.0.0.1:1/notify/{order_id}")  # a service that refuses the connection

    @app.task(
        shared=False,
        name="issue27.autoretried",
        base=GuardedTask,
        bind=True,
        autoretry_for=(Exception,),
        retry_backoff=True,
    )
    def autoretried(self: Any, order_id: int) -> None:
        post(f"http://127.0.0.1:9/charges/{order_id}")

    @app.task(shared=False, name="issue27.asks_again", base=GuardedTask, bind=True, max_attempts=3)
    def asks_again(self: Any, order_id: int) -> None:
        try:
            post(f"http://127.0.0.1:9/charges/{order_id}")
        except OSError as exc:
            raise self.retry(exc=exc, countdown=1) from exc

    @app.task(
        shared=False, name="issue27.keyed_not_handed", base=GuardedTask, bind=True, idempotency_key="r:{order_id}"
    )
    def keyed_not_handed(self: Any, order_id: int) -> None:
        post(f"http://127.0.0.1:9/refunds/{order_id}")

    @app.task(shared=False, name="issue27.keyed_handed", base=GuardedTask, bind=True, idempotency_key="c:{order_id}")
    def keyed_handed(self: Any, order_id: int) -> None:
        post(f"http://127.0.0.1:9/charges/{order_id}", key=self.request.idempotency_key)

    @app.task(shared=False, name="issue27.invalid", base=GuardedTask, bind=True)
    def invalid(self: Any, order_id: int) -> None:
        raise ValueError(f"order {order_id}: no such order")

    if unsafe:

        @app.task(shared=False, name="issue27.unsafe", base=GuardedTask, bind=True, retry_unsafe=True)
        def unsafe_task(self: Any, order_id: int) -> None:
            post(f"http://127.0.0.1:9/charges/{order_id}")

    if plain:

        @app.task(
            shared=False,
            name="issue27.plain",
            autoretry_for=(ConnectionError,),
            max_retries=20,
            default_retry_delay=5,
        )
        def plain_task(order_id: int) -> None:
            post(f"http://127.0.0.1:9/charges/{order_id}")

    return app
