"""Records that are not there yet, on a real worker over Redis: the waits ``require()`` starts (1 s, 2 s, 4 s, ...,
no attempt spent, bounded by ``record_wait`` across re-publishes, not by ``retry_later_max``), the final failure
``record_missing`` naming the model and the lookup, ``ObjectDoesNotExist`` by ``absent_records`` through the retry
gate, and ``error_patterns`` mapping a message to ``retry_later``.

Django's part (``require()`` on real rows, a record committed 2 s after the publish): tests/django_app/test_records.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from django.core.exceptions import ObjectDoesNotExist

from celery_guardrails import GuardedTask, RecordNotThereYet, RetryLater, signals, tenant_context
from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.guardrails import records
from celery_guardrails.options import TaskOptions
from celery_guardrails.options.config import validate
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.classification import classify
from celery_guardrails.runtime.delivery import Delivery
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of

TIMEOUT = 30

app = Celery("records", set_as_current=False)


@app.task(base=GuardedTask, bind=True, idempotent=True)
def idempotent(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True)
def plain(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, idempotent=True, absent_records="fail")
def failing(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, idempotent=True, permanent_errors=(ObjectDoesNotExist,))
def says_permanent(self: GuardedTask) -> None: ...


class OrderDoesNotExist(ObjectDoesNotExist):
    """What ``Order.objects.get(pk=...)`` raises when there is no such row."""


def verdict(exc: BaseException, task: Any, state: Delivery | None = None) -> tuple[str, str, str | None]:
    result = classify(exc, TaskOptions(task=task, call={}), state or Delivery())
    return result.kind.value, result.rule, result.note


def test_the_waits_double_from_one_second_and_the_last_is_cut_to_what_record_wait_leaves() -> None:
    # Given the default record_wait (60 s), Then a record that never comes is looked for after 1, 2, 4, 8, 16 s
    # and a last time as the 60 s run out
    assert records.delays(60.0) == [1.0, 2.0, 4.0, 8.0, 16.0, 29.0]
    assert records.delays(3.0) == [1.0, 2.0]
    assert records.delays(0.5) == [0.5]


def test_next_wait_counts_record_wait_from_the_first_miss_across_re_publishes() -> None:
    # Given a message whose first delivery (started at t=1000) misses its record at t=1000.2
    header: dict[str, Any] = {}
    now, waits = 1000.2, []
    while (wait := records.next_wait(header, record_wait=10.0, started=1000.0, now=now)) is not None:
        waits.append(round(wait.delay, 3))
        # When it is re-published as Retries does (the header carries when the wait began and how often it waited)
        header = {**header, headers.RECORD_SINCE: wait.since, headers.RECORD_WAITS: len(waits)}
        now += wait.delay + 0.1  # each delivery looks 0.1 s after its countdown
    # Then the waits double, and the last one ends as the 10 s from the first delivery's start run out
    assert waits == [1.0, 2.0, 4.0, 2.5]
    assert header[headers.RECORD_SINCE] == 1000.0


def test_a_malformed_or_hostile_wait_header_neither_crashes_nor_waits_for_ever() -> None:
    # Given headers whose wait fields are malformed (a string, a negative time, a bool) or absurd
    for bad in ("yesterday", -5, True, float("nan"), 10**20):
        clean = headers.sanitise({headers.RECORD_SINCE: bad, headers.RECORD_WAITS: "many"})
        # Then they are dropped as malformed, and the wait starts again from this delivery
        assert headers.RECORD_SINCE not in clean and headers.RECORD_WAITS not in clean
        assert records.next_wait(clean, record_wait=5.0, started=50.0, now=50.0) == records.RecordWait(
            delay=1.0, since=50.0
        )
    # And a huge wait counter (well formed, but hostile) is capped, not an overflow; the record_wait still bounds it
    assert records.next_wait(
        {headers.RECORD_WAITS: 10**9}, record_wait=5.0, started=50.0, now=51.0
    ) == records.RecordWait(delay=4.0, since=50.0)
    # And a wait that began in the future (another host's clock) counts from now
    assert records.next_wait(
        {headers.RECORD_SINCE: 99.0}, record_wait=5.0, started=50.0, now=60.0
    ) == records.RecordWait(delay=1.0, since=60.0)


def test_object_does_not_exist_follows_absent_records_through_the_retry_gate() -> None:
    # Given the body's Order.DoesNotExist, Then with absent_records="wait" (the default) it is a record not there yet
    assert verdict(OrderDoesNotExist("Order matching query does not exist."), idempotent)[:2] == (
        "retry_later",
        "absent_records:wait",
    )
    # And a body that may already have acted (it marks no effect) is not run again: not_idempotent, with a note
    # pointing at require()
    kind, rule, note = verdict(OrderDoesNotExist("x"), plain)
    assert (kind, rule) == ("permanent", "absent_records:wait:not_idempotent")
    assert note is not None and "self.require(queryset, **lookup)" in note
    # And with absent_records="fail" it is permanent, as is a task that lists it in permanent_errors
    assert verdict(OrderDoesNotExist("x"), failing)[:2] == ("permanent", "absent_records:fail")
    assert verdict(OrderDoesNotExist("x"), says_permanent)[:2] == ("permanent", "permanent_errors")
    # And require()'s own exception is the author's word, as RetryLater is: no gate asked, even for a plain task
    assert verdict(RecordNotThereYet("testapp.Order", "pk=1"), plain)[:2] == ("retry_later", "records:require")
    assert verdict(RetryLater("x"), plain)[:2] == ("retry_later", "RetryLater")


def test_error_patterns_may_map_a_message_to_retry_later_and_nothing_else() -> None:
    # Given error_patterns mapping a remote "not yet" to retry_later, Then the setting passes
    validate({"error_patterns": {r"(?i)not ready": "retry_later"}})
    # And a kind that is not one of the three is refused, naming them
    with pytest.raises(ConfigurationError, match="'transient', 'permanent' or 'retry_later'"):
        validate({"error_patterns": {r"(?i)not ready": "later"}})
    with pytest.raises(ConfigurationError, match="absent_records"):
        validate({"absent_records": "ignore"})
    with pytest.raises(ConfigurationError, match="record_wait"):
        validate({"record_wait": -1})


def test_a_record_that_comes_on_the_third_look_waits_1_then_2_seconds_spending_no_attempt(
    celery_worker: Any, sink: Sink, received: Any
) -> None:
    # Given a task whose record is missing on its first two runs (require() raises RecordNotThereYet), and a
    # retry_later_max of 1 (it bounds RetryLater, not a wait for a record)
    scheduled = received(signals.retry_scheduled)
    with tenant_context("acme"):
        final = tasks.behave.apply_async((sink.key, ["record:42", "record:42", "ok"]), retry_later_max=1).get(
            timeout=TIMEOUT
        )
    # Then it ran three times, each as attempt 1 and as "acme", and succeeded once
    assert [(r["run"], r["attempt"], r["tenant"]) for r in sink.items()] == [
        (1, 1, "acme"),
        (2, 1, "acme"),
        (3, 1, "acme"),
    ]
    # And every wait is in the history with its delay: the whole sequence, 1 s then 2 s
    assert [(r["n"], r["class"], r["rule"], r["delay"]) for r in final["history"]] == [
        (1, "retry_later", "records:require", 1.0),
        (1, "retry_later", "records:require", 2.0),
    ]
    assert final["history"][0]["msg"] == "testapp.Order matching pk=42 does not exist (yet)"
    assert [(s["kind"], s["rule"], s["delay"]) for s in scheduled] == [
        ("retry_later", "records:require", 1.0),
        ("retry_later", "records:require", 2.0),
    ]


def test_a_record_that_never_comes_is_a_dead_letter_record_missing_naming_the_model_and_the_lookup(
    celery_worker: Any, celery_app: Any, sink: Sink, received: Any
) -> None:
    # Given a task whose record never appears, with record_wait 2.5 s (a per-call option)
    finals = received(signals.final_failure)
    with tenant_context("acme"):
        result = tasks.behave.apply_async((sink.key, ["record:42"]), record_wait=2.5, retry_later_max=1)
    # When the wait is spent, Then the task fails with require()'s error
    with pytest.raises(RecordNotThereYet, match=r"testapp\.Order matching pk=42"):
        result.get(timeout=TIMEOUT)
    # And its dead letter says record_missing, names the model and the lookup, and keeps every wait
    letter = dead_letter_of(celery_app, result.id)
    assert (letter["reason"], letter["tenant"]) == ("record_missing", "acme")
    assert letter["exc_message"] == "testapp.Order matching pk=42 does not exist (yet)"
    history = letter["history"]
    assert [(r["n"], r["class"], r["rule"]) for r in history] == [(1, "retry_later", "records:require")] * len(history)
    # the waits: 1 s, then what the 2.5 s left (never more than 2 s), and the last look's record has no delay
    delays = [r["delay"] for r in history]
    assert delays[0] == 1.0 and delays[-1] is None and all(0 < d <= 2.0 for d in delays[1:-1])
    assert sum(delays[:-1]) <= 2.5 and len(history) <= 3
    assert "of record_wait 2.5 s" in history[-1]["note"]
    assert [f["failure"].reason for f in finals] == ["record_missing"]
    # And the body ran once per look, no more
    assert len(sink.items()) == len(history)


def test_a_remote_not_yet_mapped_to_retry_later_waits_where_a_re_run_is_safe(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given error_patterns that map a remote "not ready" to retry_later, with a short retry_later_delay
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "error_patterns": {r"(?i)not ready": "retry_later"},
        "retry_later_delay": 0.2,
    }
    # When an idempotent task meets it twice, then succeeds
    final = tasks.behave_by_default.delay(
        sink.key, ["remote:upstream not ready", "remote:upstream not ready", "ok"]
    ).get(timeout=TIMEOUT)
    # Then it waited twice, spending no attempt, each wait retry_later_delay
    assert [(r["n"], r["class"], r["rule"], r["delay"]) for r in final["history"]] == [
        (1, "retry_later", "error_patterns:(?i)not ready", 0.2),
        (1, "retry_later", "error_patterns:(?i)not ready", 0.2),
    ]
    # And a task that may have acted before the error is not run again: not_idempotent, after one run
    failed = tasks.behave_not_idempotent.delay(f"{sink.key}:n", ["remote:upstream not ready", "ok"])
    with pytest.raises(RuntimeError, match="not ready"):
        failed.get(timeout=TIMEOUT)
    assert dead_letter_of(celery_app, failed.id)["reason"] == "not_idempotent"
    assert len(Sink.of(f"{sink.key}:n").items()) == 1


def test_the_lookup_a_wait_names_is_redacted_where_it_is_kept(celery_worker: Any, sink: Sink) -> None:
    # Given a record looked up by a card number (personal data in a lookup), missing on the first run
    final = tasks.behave.delay(sink.key, ["record:4111 1111 1111 1111", "ok"]).get(timeout=TIMEOUT)
    # Then the wait's record names the model, and the card number is not kept
    (wait,) = final["history"]
    assert wait["msg"].startswith("testapp.Order matching pk=") and "4111 1111 1111 1111" not in wait["msg"]
