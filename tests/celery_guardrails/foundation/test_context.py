"""The context API: values, validation, nesting, and clearing after a task."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_guardrails import (
    ContextError,
    GuardedTask,
    correlation_context,
    current_correlation_id,
    current_tenant,
    tenant_context,
)


def test_contexts_nest_and_restore() -> None:
    assert (current_tenant(), current_correlation_id()) == (None, None)
    with tenant_context("acme"), correlation_context("outer") as outer:
        assert outer == "outer"
        with tenant_context("globex"), correlation_context() as inner:
            assert current_tenant() == "globex"
            assert len(inner) == 32 and current_correlation_id() == inner
            with tenant_context(None):
                assert current_tenant() is None
        assert (current_tenant(), current_correlation_id()) == ("acme", "outer")
    assert (current_tenant(), current_correlation_id()) == (None, None)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (42, "must be a str"),
        ("", "1 to 128"),
        ("x" * 129, "1 to 128"),
        ("a b", "may hold only"),
        ("acme\n", "may hold only"),
    ],
)
def test_bad_tenant_is_refused(value: Any, text: str) -> None:
    with pytest.raises(ContextError, match=text), tenant_context(value):
        pass


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (b"abc", "must be a str"),
        ("", "1 to 128"),
        ("a" * 129, "1 to 128"),
        ("id with space", "may hold only"),
        ("-leading", "may hold only"),
        ("ümlaut", "may hold only"),
    ],
)
def test_malformed_correlation_id_is_refused(value: Any, text: str) -> None:
    with pytest.raises(ContextError, match=text), correlation_context(value):
        pass


@pytest.mark.parametrize("good", ["0b6c4a3e-2f4b-4c1e-9a55-1f0e6b2f6d11", "Root=1-5759e988-bd862e3fe", "abc+/=="])
def test_real_request_id_formats_are_accepted(good: str) -> None:
    with correlation_context(good) as cid:
        assert cid == good


def test_bad_values_are_refused_at_publish() -> None:
    app = Celery("publish", set_as_current=False)

    @app.task(base=GuardedTask, bind=True)
    def task(self: GuardedTask) -> None: ...

    with pytest.raises(ContextError, match="tenant id must be a str"):
        task.apply_async(tenant=7)
    with pytest.raises(ContextError, match="correlation id"):
        task.apply_async(correlation_id="not valid!")


def test_eager_task_leaves_the_callers_context_as_it_was() -> None:
    # Given an eager run (Celery's apply) inside a caller's context
    app = Celery("eager", set_as_current=False)

    @app.task(base=GuardedTask, bind=True)
    def report(self: GuardedTask) -> tuple[str | None, str | None]:
        return current_tenant(), current_correlation_id()

    with tenant_context("acme"), correlation_context("caller"):
        # When the task runs with another tenant in its message
        seen = report.apply(headers={"guardrails": {"tenant": "globex", "cid": "msg"}}).get()
        # Then the task saw its message's context, and the caller's context is back afterwards
        assert tuple(seen) == ("globex", "msg")
        assert (current_tenant(), current_correlation_id()) == ("acme", "caller")
    assert (current_tenant(), current_correlation_id()) == (None, None)
