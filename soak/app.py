"""The soak's Celery app: one guarded task, ``soak.job``, whose kind says how it behaves.

Every run of a job writes its effect (a row in ``soak_effect``, a table with no unique constraint) inside the
documented exactly-once mechanism: on the Django store ``atomic=True`` (the completion mark commits in the
effect's transaction); on the Redis store the effect's own transaction, then the completion mark (at least
once: a worker killed between the two runs the body again). On the Redis store the key does not commit with the
effect, so the body marks it (``with self.effect():`` around the INSERT, inside the transaction, whose opening
connects): a failure to connect (the database restarting) came before the effect and is retried; a failure in
or after the INSERT (its COMMIT) may have acted and is not (``not_idempotent``). Unmarked, any failure of the
body counted as after an effect, and every job whose connection was refused during the restart ended
``not_idempotent`` (12 to 36 jobs a run). Kinds: ``ok``; ``transient`` (its effect rolled
back and a TransientError on its first two attempts); ``permanent`` (a PermanentError until the soak "fixes"
the bug, then replays it); ``poison`` (SIGKILLs its own process every time); ``later`` (a ``RetryLater`` of 0.3 s,
then one of 3 s, then its effect: on RabbitMQ quorum queues the first is under what native delayed delivery takes
and the second goes through the delay queue the first went through).

Every run of a body appends its job to ``runs.log`` in SOAK_DIR first (one short line: appends of a few bytes do not
interleave), so the soak counts runs and sees a loop. SOAK_QUEUE_TYPE ``quorum``: the queue is a RabbitMQ quorum
queue bound to an exchange of its own of type SOAK_EXCHANGE (``topic``: Celery's native delayed delivery carries
the countdowns; ``direct``: the worker holds them).
"""

from __future__ import annotations

import os
import signal
from contextlib import nullcontext
from pathlib import Path

import django
from celery import Celery
from django.db import InterfaceError, OperationalError, connection, transaction
from kombu import Exchange, Queue

from celery_guardrails import GuardedTask, PermanentError, RetryLater, TransientError

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "soak.settings")
django.setup()

STORE = os.environ.get("SOAK_STORE", "django")
QUEUE = os.environ.get("SOAK_QUEUE", "soak")
#: Present once the soak has "deployed the fix" for the permanent failures.
FIXED = Path(os.environ.get("SOAK_DIR", "/tmp")) / "fixed"
#: One line per run of a body (its job id).
RUNS = Path(os.environ.get("SOAK_DIR", "/tmp")) / "runs.log"
#: The waits of a ``later`` job, in seconds, one per run before its effect.
LATER_WAITS = (0.3, 3.0)

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
if os.environ.get("SOAK_QUEUE_TYPE") == "quorum":
    app.conf.task_queues = [
        Queue(
            QUEUE,
            Exchange(QUEUE, type=os.environ.get("SOAK_EXCHANGE", "topic")),
            routing_key=QUEUE,
            queue_arguments={"x-queue-type": "quorum"},
        )
    ]


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
    with RUNS.open("a") as runs:
        runs.write(f"{job}\n")
    if kind == "poison":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "later":
        waited = sum(1 for record in self.request.attempt_history if record.get("class") == "retry_later")
        if waited < len(LATER_WAITS):
            raise RetryLater(f"{job}: not ready yet (wait {waited + 1})", delay=LATER_WAITS[waited])
    attempt = int(getattr(self.request, "attempt", 1) or 1)
    # (On the Django store the effect commits with the key, atomic=True: nothing to mark; a marked block there
    # would count as an effect outside the key's transaction.)
    marked = self.effect() if STORE != "django" else nullcontext()
    with transaction.atomic():
        with marked, connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO soak_effect (job, kind, attempt, pid) VALUES (%s, %s, %s, %s)",
                [job, kind, attempt, os.getpid()],
            )
        if kind == "transient" and attempt <= 2:
            raise TransientError(f"{job}: provider busy (attempt {attempt})")
        if kind == "permanent" and not FIXED.exists():
            raise PermanentError(f"{job}: rejected by the provider")
    return "done"
