"""The example project end to end: a request's X-Request-ID and tenant reach the worker's log lines."""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.test import Client

# Imported here, at collection: a shared task registers with apps not yet finalized through a finalizer, and
# celery.contrib.testing's setup_default_app (around every test on the celery_app fixture) restores the set of
# finalizers when its test ends. Imported first inside such a test (a worker there imports every task module),
# the example tasks were never registered with the example app, and this test failed with NotRegistered when
# it ran right after one.
import example_project.shop.tasks  # noqa: F401
from example_project.celery_app import app as example_app
from tests.support.services import require
from tests.support.workers import WorkerProcess


def test_request_id_reaches_the_log_lines_of_the_task_it_enqueues(client: Client, tmp_path: Path) -> None:
    require("redis")
    example_app.set_current()
    env = {
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        **{key: os.environ[key] for key in ("EXAMPLE_BROKER_URL", "EXAMPLE_RESULT_BACKEND", "EXAMPLE_QUEUE")},
        "EXAMPLE_SQLITE_PATH": str(tmp_path / "db.sqlite3"),
    }
    # Given the example project's worker, a real `celery worker` process
    with WorkerProcess(
        app="example_project",
        queue=settings.CELERY_TASK_DEFAULT_QUEUE,
        log_path=tmp_path / "worker.log",
        env=env,
    ) as worker:
        # When a request for tenant "acme" with an X-Request-ID enqueues a receipt
        response = client.post("/orders/7/receipt", headers={"X-Request-ID": "req-example-1", "X-Tenant": "acme"})
        assert response.status_code == 202
        body = response.json()
        assert (body["tenant"], body["correlation_id"]) == ("acme", "req-example-1")
        seen = example_app.AsyncResult(body["task_id"]).get(timeout=30)
    # Then the worker ran it as "acme" under the request's id, and its log line says so
    assert (seen["tenant"], seen["correlation_id"]) == ("acme", "req-example-1")
    (line,) = [text for text in worker.log.splitlines() if "Sending the receipt of order 7" in text]
    assert "tenant=acme cid=req-example-1" in line
    assert f"task=example_project.shop.tasks.send_receipt/{body['task_id']}" in line


def test_request_without_tenant_is_refused_at_publish(client: Client) -> None:
    response = client.post("/orders/8/receipt")
    assert response.status_code == 400
    assert "requires a tenant" in response.json()["error"]
