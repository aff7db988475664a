"""``report_completion()``'s message, read back from the real broker: the completion task by name, the job's id and
output reference as its arguments, the tenant and a correlation id in the ``guardrails`` header (no job field: the
completion is not the job's own message), on ``job_completion_queue`` or the app's default queue; bad arguments
send nothing.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
import redis

from celery_guardrails import ContextError, correlation_context, tenant_context
from celery_guardrails.jobs import COMPLETION_TASK, report_completion
from tests.conftest import waiting_messages
from tests.support.services import BROKER_URLS


def taken(queue: str) -> tuple[dict[str, Any], list[Any]]:
    """The one message waiting in ``queue`` on the Redis broker, taken off it: its headers and its body."""
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    (raw,) = client.lrange(queue, 0, -1)
    client.delete(queue)
    message = json.loads(raw)
    return message["headers"], json.loads(base64.b64decode(message["body"]))


def test_a_completion_carries_the_job_the_output_and_the_tenant_on_the_default_queue(
    celery_app: Any, queue_name: str
) -> None:
    # Given a job id, and a caller that runs as another tenant, under a correlation id
    job_id = uuid.uuid4()
    with tenant_context("globex"), correlation_context("cid-42"):
        # When it reports the job's completion for tenant acme
        result = report_completion(job_id, output_ref="s3://reports/1.csv", tenant="acme", app=celery_app)
    # Then one message of the completion task waits in the app's default queue
    headers, (args, kwargs, _) = taken(queue_name)
    assert (headers["task"], headers["id"]) == (COMPLETION_TASK, result.id)
    assert (args, kwargs) == ([str(job_id)], {"output_ref": "s3://reports/1.csv"})
    # And its guardrails header names the tenant given (not the caller's), the correlation id, and no job
    header = headers["guardrails"]
    assert (header["tenant"], header["cid"]) == ("acme", "cid-42") and "job" not in header


def test_a_completion_goes_to_job_completion_queue_and_without_a_tenant_carries_none(celery_app: Any) -> None:
    # Given a completion queue of its own, and a caller running as a tenant
    queue = f"gr-test-completions-{uuid.uuid4().hex[:8]}"
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "job_completion_queue": queue}
    with tenant_context("globex"):
        # When it reports a job without a tenant
        report_completion(str(uuid.uuid4()), output_ref="ref", tenant=None, app=celery_app)
    # Then the message is on that queue, with no tenant at all (not the caller's)
    header = taken(queue)[0]["guardrails"]
    assert "tenant" not in header and header["cid"]


@pytest.mark.parametrize(
    ("job_id", "output_ref", "tenant", "error"),
    [
        ("42", "ref", "acme", ValueError),
        (uuid.uuid4(), "", "acme", ValueError),
        (uuid.uuid4(), "x" * 501, "acme", ValueError),
        (uuid.uuid4(), "ref\x00", "acme", ValueError),
        (uuid.uuid4(), b"ref", "acme", ValueError),
        (uuid.uuid4(), "ref", "acme corp", ContextError),
    ],
)
def test_bad_arguments_send_nothing(
    celery_app: Any, queue_name: str, job_id: Any, output_ref: Any, tenant: str, error: type[Exception]
) -> None:
    # When a completion is reported with a bad id, reference or tenant, Then it raises and nothing is sent
    with pytest.raises(error):
        report_completion(job_id, output_ref=output_ref, tenant=tenant, app=celery_app)
    assert waiting_messages("redis", queue_name) == 0
