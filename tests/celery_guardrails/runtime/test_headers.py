"""The header contract: one versioned header, tolerant reading, nothing lost on re-publish."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_guardrails import tenant_context
from celery_guardrails.runtime import headers
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
        "pv": 1,
    }
    published = [report["header"].pop("pub") for report in (first, retried)]
    assert first["header"] == expected
    records = retried["header"].pop("hist")
    assert retried["header"] == {**expected, "attempt": 1, "hist_n": 1}
    # and each publish stamped its own time: the retry's is a new publish, later than the first
    assert published[0] <= published[1]
    assert [(r["n"], r["class"], r["rule"]) for r in records] == [(1, "manual", "self.retry")]


def test_history_keeps_the_last_twenty_and_counts_them_all() -> None:
    header: dict[str, Any] = {"v": 1}
    for n in range(1, 26):
        header = headers.with_record(header, {"n": n}, attempt=n)
    assert [r["n"] for r in headers.history(header)] == list(range(6, 26))
    assert (header["hist_n"], header["attempt"]) == (25, 25)


# --- fuzzed headers ----------------------------------------------------------------------------------------

#: Values a fuzzed field may take: well-formed, of the wrong type, out of range, with NUL, huge, nested.
ODD = [
    None,
    True,
    -1,
    0,
    7,
    10**30,
    2**63,
    1.5,
    float("inf"),
    "",
    "x",
    "a b",
    "\x00",
    "nul\x00inside",
    "é" * 300,
    "x" * 10_000,
    [],
    ["x"],
    [{"n": "one"}],
    {},
    {"x": 1},
    {"task_name": "t", "task_id": "i", "reason": "permanent", "exc_type": "E", "exc_message": "m"},
]
FIELDS = [
    "v",
    "tenant",
    "cid",
    "opts",
    "idem",
    "attempt",
    "later",
    "deferred",
    "outage",
    "busy",
    "hist",
    "hist_n",
    "sched",
    "period",
    "dl",
    "dl_tries",
    "gave_up",
    "future_field",
]
OPTIONS = [
    {"max_attempts": "x"},
    {"tenant_required": True},
    {"idempotency_key": "has space"},
    {"idempotency_key": "ok-key"},
    {"dependency": "fuzz-dep"},
    {"retry_later_max": -1},
    {"nonsense": 1},
]
#: Why a fuzzed message may end as a dead letter (every one of them must have one).
REASONS = {"missing_tenant", "bad_idempotency_key", "permanent", "malformed_message"}


def fuzzed_header(rng: Any) -> Any:
    if rng.random() < 0.03:
        return rng.choice(["not a mapping", 42, ["list"]])
    header = {}
    for field in rng.sample(FIELDS, rng.randrange(1, 7)):
        header[field] = rng.choice(OPTIONS) if field == "opts" and rng.random() < 0.6 else rng.choice(ODD)
    return header


def test_a_thousand_fuzzed_headers_each_run_or_become_one_dead_letter(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Any
) -> None:
    import json
    import random

    from tests.conftest import waiting_messages
    from tests.support.dead_letters import dead_letter_of
    from tests.support.waiting import wait_for
    from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

    # Given 1000 messages whose guardrails header is fuzzed (seeded: a failure can be replayed), sent by name as
    # another producer would (GuardedTask's own publish would refuse some of them), and a plain one after
    rng = random.Random(20261130)
    sent = [
        celery_app.send_task("tests.proj.tasks.behave", (sink.key, ["ok"]), headers={"guardrails": fuzzed_header(rng)})
        for _ in range(1000)
    ]
    last = tasks.observe.delay()
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"retry_later_delay": 0.05}))
    # When a prefork worker takes them all
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, concurrency=2
    ) as worker:
        wait_for("every message done", lambda: all(r.ready() for r in [*sent, last]), timeout=300, every=0.5)
        wait_for("the queue empty", lambda: waiting_messages("redis", queue_name) == 0)
        # Then the worker is still up, every message ran or is exactly one dead letter with a reason
        assert worker.process is not None and worker.process.poll() is None
    assert last.state == "SUCCESS"
    failed = [r for r in sent if r.state != "SUCCESS"]
    assert all(r.state == "FAILURE" for r in failed)
    reasons = {dead_letter_of(celery_app, r.id)["reason"] for r in failed}
    assert reasons <= REASONS | {"attempts_exhausted"}, reasons
    assert "Traceback" not in worker.log or "Unrecoverable" not in worker.log
    assert len(sent) - len(failed) > 500  # most fuzz is malformed and ignored, not fatal


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(FIELDS),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
            max_leaves=12,
        ),
    )
)
def test_sanitise_never_raises_and_keeps_only_what_the_contract_allows(raw: dict[str, Any]) -> None:
    clean = headers.sanitise(raw)
    # whatever came in, every field a guardrail reads is of its type, or gone
    for field in ("attempt", "later", "deferred", "outage", "busy", "hist_n", "dl_tries"):
        assert field not in clean or (type(clean[field]) is int and clean[field] >= 0)
    assert "period" not in clean or 0 <= clean["period"] <= headers.PERIOD_MAX
    assert "sched" not in clean or isinstance(clean["sched"], str)
    assert "hist" not in clean or all(isinstance(r, dict) for r in clean["hist"])
    assert "hist" not in clean or all(headers.attempt_records([r]) == [r] for r in clean["hist"])  # checked once
    assert "gave_up" not in clean or all(isinstance(o, str) for o in clean["gave_up"])
    assert "replay_of" not in clean or (isinstance(clean["replay_of"], str) and 0 < len(clean["replay_of"]) <= 200)
    # a pending dead letter is kept whatever it holds (its guardrail checks it): its body ran already
    assert ("dl" in clean) == (raw.get("dl") is not None)
    headers.counter(clean, "attempt")
    headers.history(clean)
    headers.call_options(clean)


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (1_796_000_000.25, True),
        (1_796_000_000, True),
        (0, False),
        (-1.0, False),
        (float("nan"), False),
        (float("inf"), False),
        (True, False),
        ("1796000000", False),
        (headers.PERIOD_MAX + 1, False),
    ],
)
def test_a_malformed_publish_time_is_dropped_and_reads_as_unknown(value: Any, kept: bool) -> None:
    # Given a header whose publish time is this value, When it is sanitised, Then it is kept only when it is a
    # real instant, and read back as that instant (else as unknown, never as zero)
    clean = headers.sanitise({"v": 1, "pub": value})
    assert ("pub" in clean) is kept
    assert headers.published_at(clean) == (float(value) if kept else None)


@pytest.mark.parametrize(
    ("value", "kept"), [("5d1e-task-id", True), ("x" * 200, True), ("", False), ("x" * 201, False), (42, False)]
)
def test_a_malformed_replay_of_is_dropped(value: Any, kept: bool) -> None:
    # Given a replay's header naming the run it replays as this value, When it is sanitised, Then it is kept only
    # when it is a task id's text (a dropped one reopens nothing: the replay then runs as any duplicate would)
    assert (headers.REPLAY_OF in headers.sanitise({"v": 1, headers.REPLAY_OF: value})) is kept


def test_every_publish_stamps_its_own_publish_time(celery_app: Any) -> None:
    # Given a plain message published through the app, When it is published twice, Then each carries the
    # time of its own publish (a re-publish is a new wait in the queue)
    sent: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict((headers or {}).get("guardrails") or {}))

    from celery.signals import after_task_publish

    after_task_publish.connect(capture, weak=False)
    try:
        import time

        before = time.time()
        tasks.observe.apply_async(ignore_result=True)
        tasks.observe.apply_async(ignore_result=True)
        after = time.time()
    finally:
        after_task_publish.disconnect(capture)
    stamps = [headers.published_at(header) for header in sent]
    assert len(stamps) == 2 and all(s is not None and before - 0.01 <= s <= after + 0.01 for s in stamps)


def test_attempt_records_are_checked_field_by_field_and_cut() -> None:
    # Given a header's history as another producer may write it: 30 records, fields of wrong types, huge text,
    # NaN, a nested value under a field this release does not know
    record = {"n": 1, "start": "2026-11-30T08:00:00.000+00:00", "class": "transient", "rule": "http:503"}
    raw = [
        *([{**record, "msg": "m" * 10_000, "note": "n" * 10_000}] * 29),
        {**record, "n": "one", "delay": float("nan"), "exc": 5, "host": None, "later": {"deep": [1]}, "v2": "x" * 5000},
    ]
    # When the header is sanitised
    clean = headers.sanitise({"hist": raw})
    # Then the last 20 are kept, text cut to its length, a field of the wrong type left out, a newer release's
    # scalar field kept (cut), anything else dropped
    records = clean["hist"]
    assert len(records) == headers.HISTORY_LIMIT
    assert all(len(r["msg"]) == headers.MESSAGE_LIMIT and len(r["note"]) == 1000 for r in records[:-1])
    assert records[-1] == {**{k: v for k, v in record.items() if k != "n"}, "host": None, "v2": "x" * 1000}
    # And a history that is not a list of mappings is malformed: treated as missing
    for bad in ("[]", [1, 2], [{"n": 1}, "x"], {"n": 1}):
        assert "hist" not in headers.sanitise({"hist": bad})
