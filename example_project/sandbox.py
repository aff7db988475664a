"""A sandboxed worker: a plain Celery app holding the broker's URL and nothing else (no Django, no database).

It renders the shop's invoices from what the message carries and announces each one done by putting a completion
on the queue it already talks to (``celery_guardrails.jobs.report_completion``); the shop's trusted worker applies
it to the job, once, in the job's tenant. Run it with ``celery -A example_project.sandbox worker -Q <queue>``; the
demo starts one on ``EXAMPLE_QUEUE`` + ``-sandbox``.
"""

import json
import os

from celery import Celery

from celery_guardrails.jobs import report_completion

app = Celery("sandbox", broker=os.environ["EXAMPLE_BROKER_URL"])
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("EXAMPLE_BROKER_TRANSPORT_OPTIONS", "{}")),
    broker_transport=os.environ.get("EXAMPLE_BROKER_TRANSPORT") or None,
    task_default_queue=f"{os.environ['EXAMPLE_QUEUE']}-sandbox",
    broker_connection_retry_on_startup=True,
)
#: Where completions go: the queue the shop's trusted worker consumes (never this sandbox's own).
COMPLETIONS = os.environ["EXAMPLE_QUEUE"]


@app.task(name="sandbox.render_invoice")
def render_invoice(order_id: int, tenant: str, *, job_id: str) -> str:
    """Render the invoice of ``order_id`` (a file here) and report the job done (``job_id``: hand_off adds it)."""
    path = f"invoices/{tenant}/{order_id}.pdf"
    report_completion(job_id, output_ref=path, tenant=tenant, app=app, queue=COMPLETIONS)
    return path
