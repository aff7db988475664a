"""tenant_required on a real worker: refused without running, never looping; tenant_activator wraps the body."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import shared_task

from celery_guardrails import GuardedTask, MissingTenantError, signals, tenant_context
from tests.conftest import BOTH_BROKERS, Sink, waiting_messages
from tests.proj import tasks

TIMEOUT = 30


def test_publishing_without_a_tenant_raises_in_the_caller(celery_app: Any, sink: Sink) -> None:
    # Given a tenant_required task and no tenant in the context
    # When it is published, Then the caller gets a clear error and nothing is sent
    with pytest.raises(MissingTenantError, match=r"tests\.proj\.tasks\.tenant_only requires a tenant"):
        tasks.tenant_only.delay(sink=sink.key)
    with tenant_context(None), pytest.raises(MissingTenantError):
        tasks.tenant_only.apply_async(kwargs={"sink": sink.key})


def test_per_call_option_can_require_a_tenant(celery_app: Any) -> None:
    with pytest.raises(MissingTenantError):
        tasks.observe.apply_async(tenant_required=True)


@BOTH_BROKERS
def test_tenantless_message_is_refused_without_running_and_without_looping(
    celery_worker: Any,
    celery_app: Any,
    sink: Sink,
    queue_name: str,
    broker: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused: list[dict[str, Any]] = []

    def on_missing(sender: Any, **kwargs: Any) -> None:
        refused.append(kwargs)

    signals.missing_tenant.connect(on_missing, weak=False)
    try:
        # Given a message for a tenant_required task sent by name, from outside any tenant
        with caplog.at_level(logging.ERROR, logger="celery_guardrails"):
            result = celery_app.send_task("tests.proj.tasks.tenant_only", kwargs={"sink": sink.key})
            # Then it fails with the reason, its body never ran...
            with pytest.raises(MissingTenantError, match="requires a tenant and none was in the message"):
                result.get(timeout=TIMEOUT)
    finally:
        signals.missing_tenant.disconnect(on_missing)
    assert sink.items() == []
    # ...the signal fired once with the reason, an ERROR names the task id...
    assert [(r["task_id"], r["task_name"]) for r in refused] == [(result.id, "tests.proj.tasks.tenant_only")]
    assert any(result.id in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    # ...and the message is gone from the queue, not requeued to come back
    assert waiting_messages(broker, queue_name) == 0
    assert celery_app.AsyncResult(result.id).state == "FAILURE"


def test_message_with_a_tenant_runs(celery_worker: Any, sink: Sink) -> None:
    with tenant_context("acme"):
        report = tasks.tenant_only.delay(sink=sink.key).get(timeout=TIMEOUT)
    assert report["tenant"] == "acme"
    assert [r["task_id"] for r in sink.items()] == [report["task_id"]]


ACTIVATIONS: list[tuple[str, str]] = []


@contextmanager
def record_activation(tenant: str) -> Iterator[None]:
    ACTIVATIONS.append(("enter", tenant))
    try:
        yield
    finally:
        ACTIVATIONS.append(("exit", tenant))


@shared_task(base=GuardedTask, bind=True, tenant_activator=record_activation)
def activated(self: GuardedTask) -> list[tuple[str, str]]:
    return list(ACTIVATIONS)


def test_tenant_activator_wraps_the_body_and_is_skipped_without_tenant(celery_worker: Any) -> None:
    ACTIVATIONS.clear()
    # Given a task with an activator, run for "acme" and then without a tenant
    with tenant_context("acme"):
        inside = activated.delay().get(timeout=TIMEOUT)
    without = activated.delay().get(timeout=TIMEOUT)
    # Then the body ran inside the activation, which was exited afterwards; no activation without a tenant
    # (results travel as JSON: tuples come back as lists)
    assert inside == [["enter", "acme"]]
    assert without == [["enter", "acme"], ["exit", "acme"]]
    assert ACTIVATIONS == [("enter", "acme"), ("exit", "acme")]


def test_tenant_activator_from_app_config_by_dotted_path(celery_worker: Any, celery_app: Any) -> None:
    ACTIVATIONS.clear()
    celery_app.conf.guardrails = {"tenant_activator": f"{__name__}.record_activation"}
    with tenant_context("globex"):
        assert tasks.observe.delay().get(timeout=TIMEOUT)["tenant"] == "globex"
    assert ACTIVATIONS == [("enter", "globex"), ("exit", "globex")]
