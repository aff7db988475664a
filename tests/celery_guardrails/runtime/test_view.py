"""One resolved view per delivery (celery_guardrails.runtime.view): a delivery on a real worker reads its header once
and resolves each of its task's options once, whatever number of hooks ask.

Before the view, one keyed delivery parsed its header about 21 times and ran the lookup rule 82 times. The
counts are taken where every read ends up, whoever asks: the header's read from the request (a fresh copy each
time) and the lookup rule's read of the task attribute (its second step, run for every option not given per
call). Reads made while publishing (a retry's new message) are not the delivery's: publishing resolves with the
new message's per-call options.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import current_task, shared_task
from celery.app.task import Context

from celery_guardrails import GuardedTask
from celery_guardrails.options import TaskOptions, lookup
from celery_guardrails.runtime import delivery, headers
from celery_guardrails.runtime.task import GuardedTask as Runtime
from celery_guardrails.runtime.view import DeliveryView

FAILED_ONCE: set[str] = set()


@shared_task(
    base=GuardedTask,
    bind=True,
    idempotency_key="view:{run}",
    dependency="view-dependency",
    concurrency_key="view",
    concurrency_limit=2,
    ordering_key="view:{run}",
    backoff_base=0.05,
    backoff_max=0.1,
)
def keyed(self: GuardedTask, run: str, fail_first: bool = False) -> str:
    if fail_first and run not in FAILED_ONCE:
        FAILED_ONCE.add(run)
        # The key went downstream before any effect: the failure is safe to retry (celery_guardrails.runtime.gate).
        assert self.request.idempotency_key
        raise ConnectionError("provider unreachable")
    return run


class Reads:
    """What the worker's deliveries read, by what (the header, each option), publishing left out."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.publishing = threading.local()

    def count(self, what: str) -> None:
        if current_task and current_task.name == keyed.name and not getattr(self.publishing, "on", False):
            with self.lock:
                self.counts[what] += 1

    def options(self) -> dict[str, int]:
        return {what[7:]: n for what, n in self.counts.items() if what.startswith("option:")}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reads]:
    seen = Reads()
    from_request, task_attribute, apply_async = headers.from_request, lookup.task_attribute, Runtime.apply_async

    def counted_read(request: Any) -> dict[str, Any]:
        seen.count("header")
        return from_request(request)

    def counted_attribute(task: Any, name: str) -> Any:
        seen.count(f"option:{name}")
        return task_attribute(task, name)

    def publishing(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.publishing.on = True
        try:
            return apply_async(self, *args, **kwargs)
        finally:
            seen.publishing.on = False

    monkeypatch.setattr(headers, "from_request", counted_read)
    monkeypatch.setattr(lookup, "task_attribute", counted_attribute)
    monkeypatch.setattr(Runtime, "apply_async", publishing)
    yield seen


def test_one_delivery_reads_its_header_once_and_each_option_once(celery_worker: Any, reads: Reads) -> None:
    # Given a task with a key, a dependency's budget, a concurrency limit and an ordering key: every guardrail
    # asks about it
    # When one delivery runs it on a real worker
    run = uuid.uuid4().hex
    assert keyed.delay(run).get(timeout=30) == run
    # Then the header was read once, and no option was resolved twice, though the hooks asked for many
    assert reads.counts["header"] == 1
    options = reads.options()
    asked = {"idempotency_lease", "idempotency_retention", "dependency", "concurrency_limit", "ordering_retention"}
    assert asked <= set(options)
    assert {name: n for name, n in options.items() if n > 1} == {}


def test_a_retried_message_reads_once_per_delivery(celery_worker: Any, reads: Reads) -> None:
    # Given the same task failing once with a transient error after handing its key downstream
    # When the message is classified, retried with backoff and delivered again
    run = uuid.uuid4().hex
    assert keyed.delay(run, fail_first=True).get(timeout=30) == run
    # Then each of the two deliveries read its header once and resolved each option once (the retry's
    # classification, gate and backoff included)
    assert reads.counts["header"] == 2
    options = reads.options()
    assert {"transient_errors", "max_attempts", "backoff", "backoff_base", "idempotent"} <= set(options)
    assert {name: n for name, n in options.items() if n > 2} == {}


def test_the_view_is_read_only_and_shared_by_the_hooks_of_a_delivery(celery_app: Any) -> None:
    # Given a task whose current request carries a header with a per-call option
    request = Context(id="view-test", guardrails={"tenant": "acme", headers.OPTIONS: {"backoff_max": 2.0}})
    task = keyed._get_current_object()
    # When the request is not a delivery's (the caller's process: Celery's default request), each ask reads afresh
    assert delivery.view(task) is not delivery.view(task)
    # When Celery pushes it for a delivery and two hooks ask for its view
    task.push_request(**vars(request))
    try:
        delivery.begin(task.request)
        first, second = delivery.view(task), delivery.view(task)
        # Then they get the same one: the header as sent, the per-call option first, each value kept once read
        assert first is second
        assert isinstance(first, DeliveryView) and first.header["tenant"] == "acme"
        assert first.options["backoff_max"] == 2.0 and first.options.resolved == {"backoff_max": 2.0}
        assert delivery.redaction(task) is delivery.redaction(task)
        # And the header cannot be changed by one hook under another's feet
        with pytest.raises(TypeError):
            first.header["tenant"] = "other"  # type: ignore[index]
        # And a request pushed on top of it (Task.push_request copies the current request's attributes, the view
        # included: a direct call inside the body) reads its own
        task.push_request(guardrails={"tenant": "nested"})
        try:
            assert delivery.view(task) is not first and delivery.view(task).header["tenant"] == "nested"
        finally:
            task.pop_request()
    finally:
        task.pop_request()
    # And the next delivery reads its own
    task.push_request(id="view-test-2", guardrails={"tenant": "other"})
    try:
        delivery.begin(task.request)
        assert delivery.view(task) is not first and delivery.view(task).header["tenant"] == "other"
    finally:
        task.pop_request()
    # And outside a delivery, options are resolved the same way with the caller's per-call options
    assert TaskOptions(task=keyed, call={"backoff_max": 4.0})["backoff_max"] == 4.0
