"""The soak's Celery app: one guarded task, ``soak.job``, whose kind says how it behaves.

Every run of a job writes its effect (a row in ``soak_effect``, a table with no unique constraint) inside the
documented exactly-once mechanism: on the Django store ``atomic=True`` (the completion mark commits in the
effect's transaction); on the Redis store the effect's own transaction, then the completion mark (at least
once: a worker killed between the two runs the body again). Kinds: ``ok``; ``transient`` (its effect rolled
back and a TransientError on its first two attempts); ``permanent`` (a PermanentError until the soak "fixes"
the bug, then replays it); ``poison`` (SIGKILLs its own process every time).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import django
from celery import Celery
from django.db import InterfaceError, OperationalError, connection, transaction

from celery_guardrails import GuardedTask, PermanentError, TransientError

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "soak.settings")
django.setup()

STORE = os.environ.get("SOAK_STORE", "django")
QUEUE = os.environ.get("SOAK_QUEUE", "soak")
#: Present once the soak has "deployed the fix" for the permanent failures.
FIXED = Path(os.environ.get("SOAK_DIR", "/tmp")) / "fixed"

app = Celery("soak", broker=os.environ.get("SOAK_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # A SIGKILLed worker's messages come back after this many seconds (kombu's Redis default is an hour).
    broker_transport_options={"visibility_timeout": float(os.environ.get("SOAK_VISIBILITY_TIMEOUT", "30"))},
)


@app.task(
    base=GuardedTask,
    bind=True,
    name="soak.job",
    idempotency_key="job:{job}",
    atomic=STORE == "django",
    # The database going away mid-body (a restart, a cut) is worth another attempt.
    transient_errors=(OperationalError, InterfaceError),
    max_attempts=8,
    # A claim left by a SIGKILLed delivery on another worker is taken over when its lease runs out.
    idempotency_lease=15.0,
    backoff_base=1.0,
    backoff_max=8.0,
)
def job(self: GuardedTask, job: str, kind: str) -> str:
    if kind == "poison":
        os.kill(os.getpid(), signal.SIGKILL)
    attempt = int(getattr(self.request, "attempt", 1) or 1)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO soak_effect (job, kind, attempt, pid) VALUES (%s, %s, %s, %s)",
                [job, kind, attempt, os.getpid()],
            )
        if kind == "transient" and attempt <= 2:
            raise TransientError(f"{job}: provider busy (attempt {attempt})")
        if kind == "permanent" and not FIXED.exists():
            raise PermanentError(f"{job}: rejected by the provider")
    return "done"
