"""A sandboxed worker's side of a job (tests/django_app/test_job_completions.py): a plain ``Celery(broker=...)`` app,
no result backend, no database settings, no Django project, reports that it finished a job's work.

    python -m tests.proj.sandboxed <job id> <output ref> <tenant, or "" for none> [times]

Broker and queue from GUARDRAILS_TEST_BROKER_URL and GUARDRAILS_TEST_QUEUE (tests.support.workers.proj_env). It
sends the completion ``times`` times (a publisher that retried its publish), and prints one JSON line: the task
ids sent, and whether Django's settings or database layer were loaded (they must not be).
"""

from __future__ import annotations

import json
import os
import sys

from celery import Celery

from celery_guardrails.jobs import report_completion


def main(argv: list[str]) -> None:
    job_id, output_ref, tenant = argv[:3]
    times = int(argv[3]) if len(argv) > 3 else 1
    app = Celery("sandbox", broker=os.environ["GUARDRAILS_TEST_BROKER_URL"])
    app.conf.task_default_queue = os.environ["GUARDRAILS_TEST_QUEUE"]
    sent = [report_completion(job_id, output_ref=output_ref, tenant=tenant or None, app=app).id for _ in range(times)]
    loaded = sorted(name for name in ("django.conf", "django.db") if name in sys.modules)
    print(json.dumps({"sent": sent, "django_loaded": loaded}))


if __name__ == "__main__":
    main(sys.argv[1:])
