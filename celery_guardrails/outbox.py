"""The outbox relay in every worker: a bootstep thread that publishes the transactional outbox's rows.

The outbox itself (rows written in the caller's transaction, the relay's claim, publish and delete) is Django's:
see :mod:`django_celery_guardrails.outbox`. This step runs :func:`~django_celery_guardrails.outbox.relay` every
``outbox_relay_interval`` seconds (at once again while batches come back full) in each worker's main process,
when ``outbox_relay`` is on (default) and the ``django_celery_guardrails`` app is installed. Workers share the
rows (SKIP LOCKED on PostgreSQL). A relay failure (the database away) is logged, never the worker's end: the rows
wait in the database. ``manage.py guardrails_outbox_relay`` runs the same loop where no worker should.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

from celery_guardrails.forks import quiet
from celery_guardrails.options import app_value
from celery_guardrails.stores import django_apps_installed

logger = logging.getLogger(__name__)


def relay_loop(app: Any, stopping: threading.Event, *, interval: float | None = None, batch: int | None = None) -> None:
    """Relay until ``stopping`` is set: a pass, then a wait of ``interval`` unless the pass filled its batch."""
    from django.db import close_old_connections, connection

    from django_celery_guardrails.outbox import relay

    wait = float(app_value(app, "outbox_relay_interval") if interval is None else interval)
    size = int(app_value(app, "outbox_batch") if batch is None else batch)
    lease = float(app_value(app, "outbox_relay_lease"))
    failures = 0
    try:
        while not stopping.is_set():
            full = False
            try:
                # The project's CONN_MAX_AGE decides whether the connection lives across passes (Django's default,
                # 0, closes it); one left broken by a failed pass is closed here either way.
                with quiet():  # no pool child forked while a pass is inside the database driver
                    close_old_connections()
                    done = relay(app, batch=size, lease=lease)
                full = done.published + done.failed >= size
                if failures:
                    logger.info("Outbox relay: working again after %d failed pass(es)", failures)
                failures = 0
            except Exception:
                failures += 1
                (logger.exception if failures == 1 else logger.debug)("Outbox relay: a pass failed", exc_info=True)
            if not full:
                stopping.wait(wait)
    finally:
        connection.close()


class OutboxRelayStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: the outbox relay thread (see the module docstring)."""

    label = "Guardrails outbox relay"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        app = parent.app
        if not app_value(app, "outbox_relay") or not django_apps_installed():
            return
        self.thread = threading.Thread(
            target=relay_loop, args=(app, self.stopping), name="guardrails-outbox-relay", daemon=True
        )
        self.thread.start()

    def stop(self, parent: Any) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10)  # a batch under way finishes; its rows are deleted

    terminate = stop
