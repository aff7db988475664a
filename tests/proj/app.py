"""The Celery app that ``celery worker`` / ``celery beat`` subprocesses of the tests load.

Configured from the environment: GUARDRAILS_TEST_BROKER_URL, GUARDRAILS_TEST_REDIS_URL (results, sinks),
GUARDRAILS_TEST_RESULT_URL (results elsewhere),
GUARDRAILS_TEST_QUEUE, GUARDRAILS_TEST_GUARDRAILS (JSON for app.conf.guardrails), GUARDRAILS_TEST_ACCEPT (JSON
for accept_content), GUARDRAILS_TEST_BEAT (JSON
for beat_schedule entries: {"name": {"task": ..., "schedule": seconds, "kwargs": {...}, "options": {...}}}),
GUARDRAILS_TEST_DB_REUSE_MAX (Celery's CELERY_DB_REUSE_MAX), GUARDRAILS_TEST_KILL_AFTER (a task name: the worker
process SIGKILLs itself at that task's ``task_postrun``, after every hook),
GUARDRAILS_TEST_QUORUM (an exchange type, "topic" or "direct": the queue is a RabbitMQ quorum queue bound to an
exchange of that type named after it; see tests.support.quorum).
"""

import json
import os

from celery import Celery

redis_url = os.environ.get("GUARDRAILS_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
includes = ["tests.proj.tasks"]
if os.environ.get("DJANGO_SETTINGS_MODULE"):  # Celery's Django fixup sets Django up: database tasks too
    includes.append("tests.proj.django_tasks")
app = Celery("guardrails_tests", include=includes)
app.conf.update(
    broker_url=os.environ.get("GUARDRAILS_TEST_BROKER_URL", redis_url),
    result_backend=os.environ.get("GUARDRAILS_TEST_RESULT_URL", redis_url),
    task_default_queue=os.environ.get("GUARDRAILS_TEST_QUEUE", "guardrails-tests"),
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    beat_schedule=json.loads(os.environ.get("GUARDRAILS_TEST_BEAT", "{}")),
    broker_transport_options=json.loads(os.environ.get("GUARDRAILS_TEST_TRANSPORT_OPTIONS", "{}")),
    accept_content=json.loads(os.environ.get("GUARDRAILS_TEST_ACCEPT", '["json"]')),
)
if os.environ.get("GUARDRAILS_TEST_QUORUM"):
    from tests.support.quorum import quorum_queues

    app.conf.task_queues = quorum_queues(app.conf.task_default_queue, os.environ["GUARDRAILS_TEST_QUORUM"])
if os.environ.get("GUARDRAILS_TEST_DB_REUSE_MAX"):  # Celery's Django fixup reads it by this name
    app.conf["CELERY_DB_REUSE_MAX"] = int(os.environ["GUARDRAILS_TEST_DB_REUSE_MAX"])
app.conf.guardrails = {"store": redis_url, **json.loads(os.environ.get("GUARDRAILS_TEST_GUARDRAILS", "{}"))}

if "GUARDRAILS_TEST_KILL_AFTER" in os.environ:  # SIGKILL this worker process once that task's hooks all ran
    import signal

    from celery.signals import task_postrun

    def _kill_after(sender: object = None, **_: object) -> None:
        if getattr(sender, "name", None) == os.environ["GUARDRAILS_TEST_KILL_AFTER"]:
            os.kill(os.getpid(), signal.SIGKILL)

    task_postrun.connect(_kill_after, weak=False)

if "GUARDRAILS_TEST_SIGNAL_SINK" in os.environ:
    import redis

    from celery_guardrails import signals

    def _report_budget_exhausted(
        sender: object = None, dependency: str = "", window_end: float = 0.0, **_: object
    ) -> None:
        redis.Redis.from_url(redis_url).rpush(
            os.environ["GUARDRAILS_TEST_SIGNAL_SINK"], json.dumps({"dependency": dependency, "window_end": window_end})
        )

    signals.budget_exhausted.connect(_report_budget_exhausted, weak=False)

if "GUARDRAILS_TEST_REAPED_SINK" in os.environ:
    import redis

    from celery_guardrails import signals

    def _report_holder_reaped(sender: object = None, **details: object) -> None:
        redis.Redis.from_url(redis_url).rpush(
            os.environ["GUARDRAILS_TEST_REAPED_SINK"],
            json.dumps({"sender": getattr(sender, "name", None) or str(sender), **details}, default=str),
        )

    signals.holder_reaped.connect(_report_holder_reaped, weak=False)

if "GUARDRAILS_TEST_FENCED_SINK" in os.environ:
    import redis

    from celery_guardrails import signals

    def _report_holder_fenced(sender: object = None, **details: object) -> None:
        redis.Redis.from_url(redis_url).rpush(
            os.environ["GUARDRAILS_TEST_FENCED_SINK"],
            json.dumps({"sender": getattr(sender, "name", None) or str(sender), **details}, default=str),
        )

    signals.holder_fenced.connect(_report_holder_fenced, weak=False)
