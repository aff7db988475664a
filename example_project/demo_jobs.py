"""The demo's section on jobs a user can poll (run by ``demo.py``, which hands it its helpers).

A report submitted over HTTP (202 with the job's status URL) polled to ``succeeded``; another tenant refused with a
404; a sandboxed worker (``example_project/sandbox.py``: a plain Celery app with the broker URL only) whose
completion arrives before the job's record is readable, waited for and applied once.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoTools:
    """What the demo lends this section: its bounded waits, its workers and where logs go."""

    wait_for: Any
    start_worker: Any
    stop: Any
    var: Path


def jobs(tools: DemoTools, client: Any) -> None:
    from django.contrib.auth.models import User

    from celery_guardrails.jobs import COMPLETION_TASK, report_completion
    from django_celery_guardrails.models import Job, WaitingMessage
    from example_project.celery_app import app as main_app

    print("\n-- 20. jobs a user can poll: POST /reports/7 as tenant acme, then GET the Location until it is final")
    user, _ = User.objects.get_or_create(username="demo-reader")
    client.force_login(user)
    response = client.post("/reports/7?seconds=1", headers={"X-Tenant": "acme"})
    location = response["Location"]
    print(f"   web:    HTTP {response.status_code}, Location {location}, Retry-After {response['Retry-After']} s")
    seen: list[str] = []

    def final() -> dict[str, Any] | None:
        body: dict[str, Any] = client.get(location, headers={"X-Tenant": "acme"}).json()
        if not seen or seen[-1] != body["state"]:
            seen.append(body["state"])
        return body if body["terminal"] else None

    body = tools.wait_for("the report job to be final", final, timeout=60, every=0.1)
    print(f"   polled: {' -> '.join(seen)}; progress {body['progress']['done']}/{body['progress']['total']}")
    job = Job.objects.get(pk=body["id"])
    print(f"   history: {', '.join(entry['state'] for entry in job.history)}")
    refused = client.get(location, headers={"X-Tenant": "globex"})
    print(f"   tenant globex asks for acme's job: HTTP {refused.status_code}")

    print("\n-- 21. a sandboxed worker (broker URL only, no database) reports its work done on the queue")
    sandbox_log = tools.var / "demo-sandbox.log"
    sandbox = tools.start_worker(
        sandbox_log,
        queue=f"{os.environ['EXAMPLE_QUEUE']}-sandbox",
        name="sandbox",
        app="example_project.sandbox",
        env={"DJANGO_SETTINGS_MODULE": "", "EXAMPLE_SQLITE_PATH": "", "PYTHONPATH": str(Path(sys.path[0]))},
    )
    try:
        from example_project.sandbox import app as sandbox_app

        # The render is sent before the job's record exists: the commit that writes it comes 2 s later (a
        # publish that beat its commit, or a lagging replica).
        job_id = uuid.uuid4()
        sandbox_app.send_task(
            "sandbox.render_invoice",
            args=(99, "acme"),
            kwargs={"job_id": str(job_id)},
            queue=f"{os.environ['EXAMPLE_QUEUE']}-sandbox",
        )
        published = time.monotonic()

        def waiting() -> Any:
            """The completion's row on the admin's Waiting page, while it waits for a job it did not find."""
            return WaitingMessage.objects.filter(task_name=COMPLETION_TASK, tenant="acme").first()

        wait = tools.wait_for("the completion to find no job yet", waiting, timeout=30)
        print(f"   the completion came first: it waits ({wait.reason}: {wait.detail})")
        tools.wait_for("2 s after the send", lambda: time.monotonic() - published >= 2.0, timeout=10, every=0.05)
        late = Job.submitted(
            id=job_id,
            task_name="sandbox.render_invoice",
            task_id=uuid.uuid4().hex,
            tenant="acme",
            correlation_id="",
            detail="handed off",
        )
        print(f"   job {job_id}: its record committed 2 s after the send")
        tools.wait_for("the completion applied", lambda: Job.objects.get(pk=job_id).state == "succeeded", timeout=60)
        late.refresh_from_db()
        print(f"   job: {', '.join(entry['state'] for entry in late.history)}; output {late.output_ref}")
        again = report_completion(
            job_id, output_ref=late.output_ref, tenant="acme", app=sandbox_app, queue=os.environ["EXAMPLE_QUEUE"]
        )
        tools.wait_for("the duplicate handled", lambda: main_app.AsyncResult(again.id).state == "SUCCESS", timeout=30)
        late.refresh_from_db()
        print(
            f"   the same completion sent again: job still {late.state}, "
            f"{sum(entry['state'] == 'succeeded' for entry in late.history)} succeeded entry in its history"
        )
    finally:
        tools.stop(sandbox)
