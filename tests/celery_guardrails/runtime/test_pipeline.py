"""GuardedTask runs its guardrails' hooks in the documented order, on a real worker."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from celery import shared_task

from celery_guardrails import GuardedTask, Guardrail, current_tenant, tenant_context
from celery_guardrails.runtime.pipeline import Publication
from tests.support.waiting import wait_for

CALLS: list[tuple[str, str, Any]] = []


class Recorder(Guardrail):
    def __init__(self, *, name: str) -> None:
        self.name = name

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        CALLS.append((self.name, "publish", publication.header.get("tenant")))

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The tenant is restored before any guardrail runs: a store read here is the right tenant's.
        CALLS.append((self.name, "before_run", current_tenant()))

    @contextmanager
    def _body(self) -> Iterator[None]:
        CALLS.append((self.name, "enter", None))
        yield
        CALLS.append((self.name, "exit", None))

    def body_context(self, task: GuardedTask) -> Any:
        return self._body()

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        CALLS.append((self.name, "success", retval))

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        CALLS.append((self.name, "failure", type(exc).__name__))

    def on_retry(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        CALLS.append((self.name, "retry", type(exc).__name__))


class RecordedTask(GuardedTask):
    guardrails = (*GuardedTask.guardrails, Recorder(name="a"), Recorder(name="b"))


@shared_task(base=RecordedTask, bind=True, max_retries=1, idempotent=True)
def recorded(self: GuardedTask, outcome: str) -> str:
    CALLS.append(("body", outcome, current_tenant()))
    if outcome == "fail":
        raise KeyError("nope")
    if outcome == "retry" and self.request.retries == 0:
        raise self.retry(countdown=0)
    return "done"


@dataclass
class OnlyOnSuccess(Guardrail):
    """A plain dataclass (so not hashable) that overrides one hook."""

    name: str

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        CALLS.append((self.name, "success", retval))


class SparseTask(GuardedTask):
    guardrails = (*GuardedTask.guardrails, OnlyOnSuccess(name="s"))


@shared_task(base=SparseTask)
def sparse() -> str:
    return "done"


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    CALLS.clear()


def after_hooks_ran(last: tuple[str, str]) -> None:
    """Wait for the last after-hook: Celery calls on_success / on_failure after it stores the result, so a
    client's .get() can return before they ran."""
    wait_for(f"{last} called", lambda: bool(CALLS) and CALLS[-1][:2] == last)


def test_success_runs_hooks_in_order_then_reverse(celery_worker: Any) -> None:
    with tenant_context("acme"):
        assert recorded.delay("ok").get(timeout=30) == "done"
    after_hooks_ran(("a", "success"))
    assert CALLS == [
        ("a", "publish", "acme"),
        ("b", "publish", "acme"),
        ("a", "before_run", "acme"),
        ("b", "before_run", "acme"),
        ("a", "enter", None),
        ("b", "enter", None),
        ("body", "ok", "acme"),
        ("b", "exit", None),
        ("a", "exit", None),
        ("b", "success", "done"),
        ("a", "success", "done"),
    ]


def test_failure_hooks_in_reverse_order(celery_worker: Any) -> None:
    with tenant_context("acme"), pytest.raises(KeyError):
        recorded.delay("fail").get(timeout=30)
    after_hooks_ran(("a", "failure"))
    assert CALLS[-2:] == [("b", "failure", "KeyError"), ("a", "failure", "KeyError")]


def test_retry_publishes_again_and_runs_retry_hooks(celery_worker: Any) -> None:
    with tenant_context("acme"):
        assert recorded.delay("retry").get(timeout=30) == "done"
    after_hooks_ran(("a", "success"))
    steps = [(name, hook) for name, hook, _ in CALLS]
    # the retry is published through the same pipeline (with the message's tenant) before on_retry
    assert steps.count(("a", "publish")) == 2
    assert steps.index(("b", "retry")) < steps.index(("a", "retry"))
    assert [value for name, hook, value in CALLS if hook == "publish"] == ["acme"] * 4
    assert steps[-2:] == [("b", "success"), ("a", "success")]


def test_a_guardrail_may_be_an_unhashable_dataclass_with_one_hook(celery_worker: Any) -> None:
    # Given a task whose extra guardrail is a plain dataclass overriding only on_success
    # When it runs
    assert sparse.delay().get(timeout=30) == "done"
    # Then that hook ran, once, with the result
    after_hooks_ran(("s", "success"))
    assert CALLS == [("s", "success", "done")]
