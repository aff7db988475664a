"""A sandboxed worker for tests (``celery -A tests.proj.sandbox_worker worker``): a plain Celery app with the broker
URL only (GUARDRAILS_TEST_BROKER_URL), no Django, no database; its task reports each job done on the queue
GUARDRAILS_TEST_COMPLETIONS, where the test's trusted worker consumes completions."""

from __future__ import annotations

import os

from celery import Celery

from celery_guardrails.jobs import report_completion

app = Celery("sandbox", broker=os.environ["GUARDRAILS_TEST_BROKER_URL"])
app.conf.update(task_default_queue=os.environ["GUARDRAILS_TEST_QUEUE"], broker_connection_retry_on_startup=True)


@app.task(name="tests.sandbox.render")
def render(order_id: int, tenant: str, *, job_id: str) -> str:
    """Render order ``order_id``'s document, and report the job done (``job_id``: hand_off adds it)."""
    path = f"renders/{tenant}/{order_id}.pdf"
    report_completion(job_id, output_ref=path, tenant=tenant, app=app, queue=os.environ["GUARDRAILS_TEST_COMPLETIONS"])
    return path
