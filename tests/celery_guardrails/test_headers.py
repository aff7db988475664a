"""The header contract: one versioned header, tolerant reading, nothing lost on re-publish."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_guardrails import headers, tenant_context
from tests.conftest import BOTH_BROKERS, Sink
from tests.proj import tasks


def test_sanitise_drops_only_the_malformed_fields(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"v": 1, "tenant": "a b", "cid": 5, "opts": [], "future": {"x": 1}}
    with caplog.at_level(logging.WARNING):
        clean = headers.sanitise(raw, task_id="t-1")
    assert clean == {"v": 1, "future": {"x": 1}}
    assert all("t-1" in r.getMessage() for r in caplog.records) and len(caplog.records) == 3


@pytest.mark.parametrize(
    ("sched", "period", "kept"),
    [
        ("nightly", 1_800_000_000, {"sched": "nightly", "period": 1_800_000_000}),
        ("", 1_800_000_000, {"period": 1_800_000_000}),
        ("x" * 201, 1_800_000_000, {"period": 1_800_000_000}),
        (["nightly"], "1800000000", {}),
        ("nightly", -5, {"sched": "nightly"}),
        ("nightly", True, {"sched": "nightly"}),
    ],
)
def test_a_malformed_schedule_or_period_is_dropped(sched: Any, period: Any, kept: dict[str, Any]) -> None:
    # A scheduled message with a bad schedule name or period runs as a plain message (no ledger record)
    assert headers.sanitise({"v": 1, "sched": sched, "period": period}) == {"v": 1, **kept}


def test_message_without_header_reads_as_empty() -> None:
    class Request:
        id = "t-2"
        headers = None

    assert headers.from_request(Request()) == {}
    assert headers.call_options({}) == {}


@BOTH_BROKERS
def test_retry_keeps_version_per_call_options_and_unknown_fields(celery_worker: Any, sink: Sink, broker: str) -> None:
    # Given a message from a newer release with a field this one does not know, and a per-call option
    with tenant_context("acme"):
        tasks.header_echo.apply_async(
            kwargs={"sink": sink.key},
            headers={"guardrails": {"future_field": "keep-me"}},
            tenant_required=True,
            correlation_id="req-h-1",
        ).get(timeout=30)
    first, retried = sink.wait(2)
    # Then the retry's header is the same mapping (version, context, per-call options, unknown field), plus
    # the manual self.retry() counted as an attempt and recorded in the history
    expected = {
        "v": 1,
        "tenant": "acme",
        "cid": "req-h-1",
        "opts": {"tenant_required": True},
        "future_field": "keep-me",
    }
    assert first["header"] == expected
    records = retried["header"].pop("hist")
    assert retried["header"] == {**expected, "attempt": 1, "hist_n": 1}
    assert [(r["n"], r["class"], r["rule"]) for r in records] == [(1, "manual", "self.retry")]


def test_history_keeps_the_last_twenty_and_counts_them_all() -> None:
    header: dict[str, Any] = {"v": 1}
    for n in range(1, 26):
        header = headers.with_record(header, {"n": n}, attempt=n)
    assert [r["n"] for r in headers.history(header)] == list(range(6, 26))
    assert (header["hist_n"], header["attempt"]) == (25, 25)
