"""Retries on a real worker over Redis: classification, backoff sequences, RetryLater, history, final failure."""

from __future__ import annotations

import logging
import random
import statistics
from datetime import datetime
from typing import Any

import pytest
from celery import group

from celery_guardrails import PermanentError, TransientError, signals, tenant_context
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of

TIMEOUT = 30


def runs(sink: Sink) -> list[dict[str, Any]]:
    return sink.items()


def use_random(app: Any, source: Any) -> None:
    app.conf.guardrails = {**app.conf.guardrails, "backoff_random": source}


@pytest.mark.smoke
def test_two_transient_failures_then_success_run_three_times_with_exact_delays(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    # Given an injected random source, and a task that fails transiently twice, then succeeds
    use_random(celery_app, random.Random(7).random)
    scheduled = received(signals.retry_scheduled)
    with tenant_context("acme"):
        final = tasks.behave.delay(sink.key, ["transient", "transient", "ok"]).get(timeout=TIMEOUT)
    # Then it ran exactly 3 times, as attempts 1, 2, 3, each as "acme"
    assert [(r["run"], r["attempt"], r["tenant"]) for r in runs(sink)] == [
        (1, 1, "acme"),
        (2, 2, "acme"),
        (3, 3, "acme"),
    ]
    # And the delays are equal jitter (the default) over base 0.05 s for the whole sequence: half fixed, half
    # random of 0.05 * 2**n
    expected_random = random.Random(7)
    expected = [round(0.05 * 2**n * (1 + expected_random.random()) / 2, 3) for n in (1, 2)]
    assert [round(s["delay"], 3) for s in scheduled] == expected
    assert [r["delay"] for r in final["history"]] == expected
    assert [(r["n"], r["class"], r["rule"], r["exc"]) for r in final["history"]] == [
        (1, "transient", "TransientError", "celery_guardrails.exceptions.TransientError"),
        (2, "transient", "TransientError", "celery_guardrails.exceptions.TransientError"),
    ]
    for record in final["history"]:
        assert record["host"] and record["msg"].startswith("run ")
        assert datetime.fromisoformat(record["start"]) <= datetime.fromisoformat(record["end"])


def test_a_transient_error_is_first_retried_no_sooner_than_the_default_floor(
    celery_worker: Any, sink: Sink, received: Any
) -> None:
    # Given a task with no backoff option at all (the documented defaults: equal jitter over 1 s)
    scheduled = received(signals.retry_scheduled)
    # When its first run fails transiently (a provider's 503, say) and the second succeeds
    tasks.behave_by_default.delay(sink.key, ["transient", "ok"]).get(timeout=TIMEOUT)
    # Then the retry was scheduled 1-2 s out (not 13 ms), and the second run really started 1 s or more after
    # the first one failed
    first, second = runs(sink)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert [1.0 <= s["delay"] < 2.0 for s in scheduled] == [True]
    failed_at = datetime.fromisoformat(second["history"][0]["end"])
    assert (datetime.fromisoformat(second["started"]) - failed_at).total_seconds() >= 1.0
    assert second["history"][0]["delay"] == round(scheduled[0]["delay"], 3)


def test_decorrelated_jitter_sequence(celery_worker: Any, celery_app: Any, sink: Sink, received: Any) -> None:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "backoff": "decorrelated_jitter"}
    use_random(celery_app, random.Random(11).random)
    scheduled = received(signals.retry_scheduled)
    tasks.behave.delay(sink.key, ["transient", "transient", "transient", "ok"]).get(timeout=TIMEOUT)
    rng, previous, expected = random.Random(11), 0.05, []
    for _ in range(3):
        previous = min(10.0, 0.05 + rng.random() * (3 * previous - 0.05))
        expected.append(round(previous, 3))
    assert [round(s["delay"], 3) for s in scheduled] == expected


def test_fifty_simultaneous_failures_retry_spread_out(celery_worker: Any, received: Any, sink: Sink) -> None:
    # Given 50 tasks that fail at (nearly) the same instant, with real randomness
    scheduled = received(signals.retry_scheduled)
    group(tasks.behave.s(f"{sink.key}:{i}", ["transient", "ok"]) for i in range(50)).delay().get(timeout=TIMEOUT)
    delays = [s["delay"] for s in scheduled]
    # Then their retry delays are spread over the whole range, not bunched (loose bounds: no timing)
    assert len(delays) == 50
    # (at microseconds: 50 uniform draws over 50 ms into 500 bins of 0.1 ms collide ~2.5 times on average,
    # which made a ">= 45 distinct" bound at 4 decimals fail in about 2% of runs)
    assert len({round(d, 6) for d in delays}) >= 45
    # (equal jitter: uniform over [0.05, 0.1), never sooner than backoff_base)
    assert 0.05 <= min(delays) < 0.0625 and 0.0875 < max(delays) < 0.1
    assert statistics.pstdev(delays) > 0.004  # a uniform spread over [0.05, 0.1) has about 0.0072


@pytest.mark.smoke
def test_max_attempts_reached_then_final_failure_with_the_whole_history(
    celery_worker: Any, sink: Sink, received: Any, caplog: pytest.LogCaptureFixture
) -> None:
    finals = received(signals.final_failure)
    with tenant_context("acme"), caplog.at_level(logging.ERROR), pytest.raises(TransientError):
        tasks.behave.apply_async((sink.key, ["transient"]), max_attempts=4).get(timeout=TIMEOUT)
    assert [r["attempt"] for r in runs(sink)] == [1, 2, 3, 4]
    (final,) = [f["failure"] for f in finals]
    assert (final.reason, final.attempts, final.tenant) == ("attempts_exhausted", 4, "acme")
    assert [(r["n"], r["class"]) for r in final.history] == [(n, "transient") for n in (1, 2, 3, 4)]
    assert [r["delay"] is not None for r in final.history] == [True, True, True, False]
    assert any(
        "failed finally (attempts_exhausted) after 4 attempt(s)" in r.getMessage() and final.task_id in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("step", "error", "rule"),
    [
        ("permanent", PermanentError, "PermanentError"),
        ("value_error", ValueError, "permanent_errors"),
        ("remote:upstream said 404 Not Found", RuntimeError, "error_patterns:(?i)\\b404 not found\\b"),
    ],
)
def test_permanent_errors_run_once(
    celery_worker: Any, sink: Sink, received: Any, step: str, error: type, rule: str
) -> None:
    finals = received(signals.final_failure)
    with pytest.raises(error):
        tasks.behave.delay(sink.key, [step]).get(timeout=TIMEOUT)
    assert len(runs(sink)) == 1
    (final,) = [f["failure"] for f in finals]
    assert final.reason == "permanent"
    assert final.history[-1]["rule"] == rule


def test_http_422_runs_once_and_http_503_waits_for_retry_after(
    celery_worker: Any, sink: Sink, provider: str, received: Any
) -> None:
    import httpx

    finals, scheduled = received(signals.final_failure), received(signals.retry_scheduled)
    # An HTTP 422 (httpx) is permanent: one run
    # (the result backend rebuilds httpx.HTTPStatusError as its base class)
    with pytest.raises(httpx.HTTPError):
        tasks.behave.delay(f"{sink.key}:422", [f"httpx:{provider}/status/422"]).get(timeout=TIMEOUT)
    assert len(Sink.of(f"{sink.key}:422").items()) == 1
    assert finals[0]["failure"].history[-1]["rule"] == "http:422"
    # An HTTP 503 with Retry-After: 7 (requests) is retried after 7 seconds, not less
    tasks.behave.delay(sink.key, [f"get:{provider}/status/503?retry_after=7", "ok"]).get(timeout=TIMEOUT)
    first, second = runs(sink)
    assert [s["delay"] for s in scheduled] == [7.0]
    assert first["attempt"] == 1 and second["attempt"] == 2
    failed_at = datetime.fromisoformat(second["history"][0]["end"])
    assert (datetime.fromisoformat(second["started"]) - failed_at).total_seconds() >= 7.0
    assert second["history"][0]["rule"] == "http:503"


def test_unknown_error_not_retried_unless_idempotent(celery_worker: Any, sink: Sink, received: Any) -> None:
    finals = received(signals.final_failure)
    with pytest.raises(RuntimeError):
        tasks.behave_not_idempotent.delay(sink.key, ["unknown", "ok"]).get(timeout=TIMEOUT)
    assert len(runs(sink)) == 1
    assert finals[0]["failure"].reason == "not_idempotent"
    # the same error in a task declared idempotent is retried
    other = Sink.of(f"{sink.key}:idem")
    tasks.behave.delay(other.key, ["unknown", "ok"]).get(timeout=TIMEOUT)
    assert [r["history"][-1]["rule"] if r["history"] else None for r in other.items()] == [
        None,
        "unknown_errors:auto",
    ]


def test_a_store_error_the_body_raises_is_the_tasks_error_not_an_outage(
    celery_worker: Any, sink: Sink, received: Any
) -> None:
    finals = received(signals.final_failure)
    # Given a task that is not idempotent whose own code meets the guardrails store down (a guarded publish)
    # When it runs, Then it is not put back as an outage (run again, no attempt spent, for ever): it is
    # classified as any error, and not retried (the body may have acted)
    with pytest.raises(Exception, match="unavailable"):
        tasks.behave_not_idempotent.delay(sink.key, ["store_down", "ok"]).get(timeout=TIMEOUT)
    assert len(runs(sink)) == 1
    assert finals[0]["failure"].reason == "not_idempotent"


def test_a_task_that_is_not_idempotent_runs_once_on_a_read_timeout_and_is_dead_lettered(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any, provider: str, provider_requests: list[str]
) -> None:
    finals = received(signals.final_failure)
    # Given a task that is not idempotent, calling a provider that takes the request and answers too late
    with pytest.raises(Exception, match="timed out"):
        tasks.behave_not_idempotent.delay(sink.key, [f"get_quick:{provider}/slow/2", "ok"]).get(timeout=TIMEOUT)
    # Then it ran once, the provider saw one request, and the final failure says why it was not retried
    assert len(runs(sink)) == 1 and provider_requests == ["/slow/2"]
    [final] = [f["failure"] for f in finals]
    assert (final.reason, final.history[-1]["rule"]) == ("not_idempotent", "http:transport:not_idempotent")
    assert dead_letter_of(celery_app, final.task_id)["reason"] == "not_idempotent"


def test_a_body_that_marks_nothing_is_not_retried_even_on_a_refused_connection(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    finals = received(signals.final_failure)
    # Given a task that is not idempotent and marks no effect, whose call finds nothing listening
    with pytest.raises(Exception, match="Connection refused"):
        tasks.behave_not_idempotent.delay(sink.key, ["get_quick:http://127.0.0.1:9", "ok"]).get(timeout=TIMEOUT)
    # Then the refusal proves only that this call sent nothing, not that the body did nothing before it: one run,
    # a final failure that says how to make it retryable
    assert [r["run"] for r in runs(sink)] == [1]
    [final] = [f["failure"] for f in finals]
    assert (final.reason, final.history[-1]["rule"]) == ("not_idempotent", "http:transport:not_idempotent")
    assert "with self.effect()" in final.history[-1]["note"]


def test_retry_later_consumes_no_attempt_and_keeps_the_tenant(celery_worker: Any, sink: Sink) -> None:
    with tenant_context("acme"):
        tasks.behave.delay(sink.key, ["later", "later", "later", "ok"]).get(timeout=TIMEOUT)
    reports = runs(sink)
    assert [(r["run"], r["attempt"], r["tenant"]) for r in reports] == [(n, 1, "acme") for n in (1, 2, 3, 4)]
    assert [r["class"] for r in reports[-1]["history"]] == ["retry_later"] * 3


def test_retry_later_is_bounded(celery_worker: Any, sink: Sink, received: Any) -> None:
    finals = received(signals.final_failure)
    with pytest.raises(Exception, match="not readable yet"):
        tasks.behave.apply_async((sink.key, ["later"]), retry_later_max=3).get(timeout=TIMEOUT)
    assert len(runs(sink)) == 4
    assert finals[0]["failure"].reason == "retry_later_exhausted"


def test_malformed_attempt_history_is_ignored_with_a_warning(
    celery_worker: Any, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        report = tasks.behave.apply_async(
            (sink.key, ["transient", "ok"]),
            headers={"guardrails": {"hist": "garbage", "attempt": "two", "hist_n": -1}},
        ).get(timeout=TIMEOUT)
    assert report["attempt"] == 2 and len(report["history"]) == 1
    messages = caplog.text
    assert "malformed 'hist'" in messages and "malformed 'attempt'" in messages
