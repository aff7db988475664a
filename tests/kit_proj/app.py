"""A project as a user of the test kit has one: a Celery app on the real broker, the Django store, and tasks
written twice, once wrongly (plain Celery, the way handlers are often written) and once guarded.

The kit's own tests (tests/celery_guardrails/testing) run each helper on both: the wrong handler must fail
the helper's assertion, the guarded one pass it.
"""

from celery import Celery

from tests.support.services import BROKER_URLS, REDIS_URL


def make_app(name: str, includes: list[str], *, broker: str = "redis") -> Celery:
    app = Celery(name, include=includes)
    app.conf.update(
        broker_url=BROKER_URLS[broker],
        result_backend=REDIS_URL,
        task_default_queue="kit-tests",
        broker_connection_retry_on_startup=True,
        result_expires=600,
        worker_hijack_root_logger=False,
    )
    app.conf.guardrails = {
        "store": "django",
        "dead_letter_sinks": ["django"],
        "activity": False,
        "outbox_relay": False,
        # Short waits: a test waits for every redelivery and retry the kit causes.
        "backoff_base": 0.2,
        "backoff_max": 1.0,
        "retry_later_delay": 0.2,
    }
    return app


app = make_app("kit_tests", ["tests.kit_proj.tasks"])
