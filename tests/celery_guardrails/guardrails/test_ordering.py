"""Ordering per key on real workers over Redis, with the Redis store (the store rules for every store kind:
tests/celery_guardrails/stores/test_ordering_rules.py).

The task ``tests.proj.tasks.ordered_append`` is ordered per ``stream`` (and keyed per message, as an ordered
task should be) and appends its sequence number to a Redis list: the list is the order the bodies ran in.
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails import StoreUnavailableError, signals
from celery_guardrails.operations import status as status_module
from celery_guardrails.operations.collectors import StateCollector
from celery_guardrails.stores import get_store
from celery_guardrails.stores.redis_ordering import order_key
from tests.conftest import Sink, waiting_messages
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

TIMEOUT = 60
#: Seconds a worker's clock reading may precede the signal it sends after it (the store's round trips, a busy host).
SLACK = 0.2
TASK = "tests.proj.tasks.ordered_append"


@pytest.fixture
def stream() -> str:
    """A stream of this test run only (ordering keys live on in Redis for their retention)."""
    return f"s-{uuid.uuid4().hex[:10]}"


def scoped(stream: str) -> str:
    return f"{TASK}:-:stream:{stream}"


def ran(sink: Sink, stream: str | None = None) -> list[int]:
    """The sequence numbers the bodies appended, in the order they ran (of one stream, or all)."""
    return [item["seq"] for item in sink.items() if stream is None or item["stream"] == stream]


def ordered_header(stream: str, sequence: Any) -> dict[str, Any]:
    """Message headers of a message published before with ``sequence`` (a redelivery, or a late one)."""
    return {"guardrails": {"ord": f"stream:{stream}", "ord_seq": sequence}}


@pytest.fixture
def worker(celery_app: Any, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A real prefork worker (4 processes) on the test's queue; the test publishes with ``celery_app``."""
    env = proj_env(queue=queue_name)
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, concurrency=4
    ) as process:
        yield process  # type: ignore[misc]


def test_100_messages_delivered_shuffled_run_in_sequence_order(worker: WorkerProcess, sink: Sink, stream: str) -> None:
    # Given 100 messages of one key published in order, each delivered after a random countdown (seeded), so
    # they reach the 4 worker processes shuffled
    jitter = random.Random(14)
    countdowns = [jitter.uniform(0, 2.0) for _ in range(100)]
    assert sorted(range(100), key=countdowns.__getitem__) != list(range(100))
    results = [tasks.ordered_append.apply_async((stream, n, sink.key), countdown=c) for n, c in enumerate(countdowns)]
    # Then the bodies ran in sequence order, each once, on its first attempt (waiting spent none)
    items = sink.wait(100, timeout=120)
    assert [item["seq"] for item in items] == list(range(1, 101))
    assert {item["attempt"] for item in items} == {1}
    assert [result.get(timeout=TIMEOUT) for result in results] == list(range(1, 101))
    # And early ones did wait for their turn
    assert "waits for" in worker.log


def test_a_wait_on_one_key_does_not_hold_another(worker: WorkerProcess, celery_app: Any, sink: Sink) -> None:
    # Given key A's number 1 handed out and not published yet (its publisher is slow), then A's 2..20 and key
    # B's 20 messages published interleaved, each after a random countdown (seeded). (A gap held by the test, not
    # a countdown racing the worker: a busy host once ran B slower than A's countdown.)
    a, b = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    get_store(celery_app).order_next(scoped(a), now=time.time(), retention=3600.0)
    jitter = random.Random(5)
    for n in range(20):
        if n:
            tasks.ordered_append.apply_async((a, n, sink.key), countdown=jitter.uniform(0, 1.0))
        tasks.ordered_append.apply_async((b, n, sink.key), countdown=jitter.uniform(0, 1.0))
    # Then all of B runs, in its order, while A waits for its first message
    sink.wait(20, timeout=90)
    assert ran(sink, b) == list(range(1, 21)) and ran(sink, a) == []
    # When A's number 1 arrives (its header carries the number it was handed)
    tasks.ordered_append.apply_async((a, 0, sink.key), headers=ordered_header(a, 1))
    # Then A runs in its own order, after B
    sink.wait(40, timeout=90)
    assert ran(sink, a) == list(range(1, 21))
    assert [item["stream"] for item in sink.items()] == [b] * 20 + [a] * 20


def test_a_worker_killed_mid_body_its_successors_wait_and_the_order_is_kept(
    worker: WorkerProcess, sink: Sink, stream: str
) -> None:
    # Given 4 messages of a key; the process running 2 is SIGKILLed mid-body on its first run
    results = [
        tasks.ordered_append.apply_async((stream, n, sink.key), {"fail": "kill_first" if n == 2 else None})
        for n in range(1, 5)
    ]
    # Then 2 is given back and runs again in its turn (no attempt spent); 3 and 4 waited for it
    assert [r.get(timeout=TIMEOUT) for r in results] == [1, 2, 3, 4]
    assert [(item["n"], item["seq"], item["attempt"]) for item in sink.items()] == [(n, n, 1) for n in range(1, 5)]
    assert "exited prematurely: signal 9 (SIGKILL)" in worker.log


def test_a_message_whose_turn_is_over_is_skipped_and_recorded(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str, received: Any
) -> None:
    stale = received(signals.stale_skipped)
    # Given message 1 of a key ran
    assert tasks.ordered_append.delay(stream, 1, sink.key).get(timeout=TIMEOUT) == 1
    # When message 1 comes again (a redelivery whose first ack was lost: its header carries sequence 1)
    again = tasks.ordered_append.apply_async((stream, 1, sink.key), headers=ordered_header(stream, 1))
    # Then its body does not run; it succeeds with None, and is recorded: signal, log, the key's stale count
    assert again.get(timeout=TIMEOUT) is None
    assert ran(sink) == [1]
    assert [(s["task_id"], s["key"], s["sequence"], s["done"]) for s in stale] == [(again.id, scoped(stream), 1, 1)]
    client = get_store(celery_app).client  # type: ignore[attr-defined]
    assert client.hmget(order_key(scoped(stream)), "stale", "done", "issued") == [b"1", b"1", b"1"]
    # And the key goes on: the next message is 2
    assert tasks.ordered_append.delay(stream, 2, sink.key).get(timeout=TIMEOUT) == 2


def test_a_permanent_failure_in_the_middle_does_not_stop_the_key(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str
) -> None:
    # Given 5 messages of a key; 3 fails permanently; 2 is delivered late, so 3, 4 and 5 wait for it
    results = [
        tasks.ordered_append.apply_async(
            (stream, n, sink.key), {"fail": "permanent" if n == 3 else None}, countdown=0.5 if n == 2 else 0
        )
        for n in range(1, 6)
    ]
    # Then 3 is dead-lettered in its turn and the key moves on past it: 4 and 5 run, in order
    assert [r.get(timeout=TIMEOUT, propagate=False) for r in (results[0], results[1], results[3], results[4])] == [
        1,
        2,
        4,
        5,
    ]
    assert ran(sink) == [1, 2, 4, 5]
    record = dead_letter_of(celery_app, results[2].id)
    assert (record["reason"], record["header"]["ord_seq"]) == ("permanent", 3)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ({"ord": "stream:x", "ord_seq": "3"}, "ord_seq"),
        ({"ord_seq": 3}, "'ord' is missing"),
        ({"ord": "stream:x"}, "ord_seq"),
        ({"ord": "stream x", "ord_seq": 3}, "whitespace"),
    ],
)
def test_a_malformed_ordering_header_is_dead_lettered(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str, header: dict[str, Any], problem: str
) -> None:
    # Given a message whose ordering fields were tampered with (or written by a broken producer)
    result = tasks.ordered_append.apply_async((stream, 1, sink.key), headers={"guardrails": header})
    # Then it does not run, unordered or otherwise: it is dead-lettered as malformed, saying what is wrong
    result.get(timeout=TIMEOUT, propagate=False)
    assert result.state == "FAILURE"
    record = dead_letter_of(celery_app, result.id)
    assert record["reason"] == "malformed_message"
    assert "malformed ordering header" in record["exc_message"] and problem in record["exc_message"]
    assert ran(sink) == []


def gap_records(app: Any, stream: str) -> list[dict[str, Any]]:
    """The records of sequence numbers of ``stream``'s key given up as lost, in the dead-letter stream."""
    from celery_guardrails.runtime.dead_letters import STREAM

    client = get_store(app).client  # type: ignore[attr-defined]
    records = [json.loads(entry[b"record"]) for _, entry in client.xrange(STREAM)]
    # (Other tests' records share the stream: a record cut to its bounds keeps fewer fields.)
    return [
        r
        for r in records
        if r.get("reason") == "ordering_gap_skipped" and (r.get("header") or {}).get("ord") == f"stream:{stream}"
    ]


def test_a_gap_that_never_fills_is_given_up_and_the_late_one_dead_lettered(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str, received: Any
) -> None:
    skipped = received(signals.ordering_gap_skipped)
    dead = received(signals.dead_lettered)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "ordering_gap_timeout": 1.0}
    # Given number 1 of a key was handed out but its message never published (the broker failed after it)
    get_store(celery_app).order_next(scoped(stream), now=0.0, retention=3600.0)
    # When 2 and 3 are published
    started = time.time()
    second = tasks.ordered_append.delay(stream, 2, sink.key)
    third = tasks.ordered_append.delay(stream, 3, sink.key)
    # Then they wait for 1 for ordering_gap_timeout, then 2 gives 1 up and runs, then 3
    assert (second.get(timeout=TIMEOUT), third.get(timeout=TIMEOUT)) == (2, 3)
    assert ran(sink) == [2, 3]
    assert [(s["task_id"], s["key"], s["first"], s["last"]) for s in skipped] == [(second.id, scoped(stream), 1, 1)]
    assert skipped[0]["waited"] >= 1.0
    # And the number that never came is recorded durably, once: a dead letter ordering_gap_skipped naming the
    # task, the key and the number, when its gap opened and when it was given up; no arguments, no attempt
    (record,) = gap_records(celery_app, stream)
    assert (record["task_name"], record["reason"], record["header"], record["attempts"]) == (
        TASK,
        "ordering_gap_skipped",
        {"ord": f"stream:{stream}", "ord_seq": 1, "ord_seq_last": 1},
        0,
    )
    assert (record["args"], record["kwargs"], record["history"]) == ([], {}, [])
    assert f"sequence number 1 of ordering key {scoped(stream)} never came" in record["exc_message"]
    opened, given_up = (datetime.fromisoformat(record[f]).timestamp() for f in ("first_failed_at", "last_failed_at"))
    assert started - 1 < opened < given_up and given_up - opened >= 1.0
    # ... told to alerts and metrics as every new dead letter is; the key owes nothing more
    assert [d["failure"].task_id for d in dead] == [record["task_id"]]
    assert get_store(celery_app).client.hget(order_key(scoped(stream)), "skip_owed") == b"0"  # type: ignore[attr-defined]
    # When message 1 turns up after all: it is dead-lettered (its turn was given up), not dropped as stale
    late = tasks.ordered_append.apply_async((stream, 1, sink.key), headers=ordered_header(stream, 1))
    late.get(timeout=TIMEOUT, propagate=False)
    record = dead_letter_of(celery_app, late.id)
    assert record["reason"] == "ordering_gap" and "given up as lost" in record["exc_message"]
    assert ran(sink) == [2, 3]


def test_a_held_gap_backs_off_and_shows_in_status_metrics_and_one_alert(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    url, alerts = webhook
    base, cap, alert_after, hold = 0.1, 2.0, 1.5, 6.0  # retry_later_delay is ordered_append's own 0.1 s
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "ordering_wait_max": cap,
        "ordering_gap_alert_after": alert_after,
        "alert_channels": ["webhook"],
        "alert_webhooks": [url],
        "alert_throttle": 0.01,  # not throttled by an earlier run of this test (the store outlives it)
    }
    looks: list[tuple[float, float]] = []  # (when, delay) of each wait of message 2

    def waited(sender: Any = None, task_id: str = "", delay: float = 0.0, rule: str = "", **_: Any) -> None:
        if task_id == second.id and rule == "ordering:wait":
            looks.append((time.time(), delay))

    signals.retry_scheduled.connect(waited, weak=False)
    try:
        # Given number 1 of a key handed out and not published yet (its publisher is slow), and 2 published
        get_store(celery_app).order_next(scoped(stream), now=time.time(), retention=3600.0)
        second = tasks.ordered_append.delay(stream, 2, sink.key)
        wait_for("2 waiting", lambda: len(looks) >= 1)
        client = get_store(celery_app).client  # type: ignore[attr-defined]
        since = float(client.hget(order_key(scoped(stream)), "gap_since"))
        # When the gap is held past ordering_gap_alert_after
        wait_for("the alert", lambda: alerts, timeout=10)
        # Then the wait is a status line, a metric, and one alert to the task's owner
        read = status_module.gather(celery_app)
        assert read.ordering is not None and read.ordering.waiting >= 1
        assert [(w.waiting_for, w.lowest, w.since) for w in read.ordering.oldest if w.key == scoped(stream)] == [
            (1, 2, since)
        ]
        assert re.search(rf"\n  {re.escape(scoped(stream))} +#1 +#2 +\d", status_module.render(read))
        scraped = {s.name: s.value for family in StateCollector(celery_app).collect() for s in family.samples}
        assert scraped["celery_guardrails_ordering_keys_waiting"] >= 1
        assert scraped["celery_guardrails_ordering_oldest_wait_seconds"] >= alert_after
        ((alert,),) = [[a for a in alerts if a["subject"].startswith("Ordering key waits")]]
        assert alert["ordering"]["key"] == scoped(stream) and alert["ordering"]["waiting_for"] == 1
        assert alert["ordering"]["waited_seconds"] >= alert_after
        # When 1 arrives after ``hold`` seconds (its header carries the number it was handed)
        time.sleep(max(0.0, since + hold - time.time()))
        first = tasks.ordered_append.apply_async((stream, 1, sink.key), headers=ordered_header(stream, 1))
        # Then 1 runs, then 2 at its next look (at most ordering_wait_max later), each once
        assert (first.get(timeout=TIMEOUT), second.get(timeout=TIMEOUT)) == (1, 2)
        assert ran(sink) == [1, 2]
    finally:
        signals.retry_scheduled.disconnect(waited)

    # And message 2 looked back with delays that doubled from retry_later_delay as the key stayed stuck (75 to
    # 100% of the time waited so far, random), cut once to look at ordering_gap_alert_after, then at most
    # ordering_wait_max: a handful of looks for the whole hold, where a fixed 0.1 s made one every 0.1 s
    def longest(waited: float) -> float:
        """The longest delay of a look ``waited`` seconds into the wait: cut to look at ordering_gap_alert_after."""
        cut = alert_after - waited + 0.01 if waited < alert_after else cap
        return max(0.01, min(cap, max(base, waited), cut))

    bounds = []
    for when, delay in looks:
        # The worker read its clock up to SLACK before the signal reached this receiver: any moment in between
        moments = [when - since - SLACK * i / 40 for i in range(41)]
        low, high = 0.75 * min(map(longest, moments)), max(map(longest, moments))
        bounds.append((round(low, 3), round(delay, 3), round(high, 3)))
    assert all(low - 0.001 <= delay <= high + 0.001 for low, delay, high in bounds), bounds
    assert 5 <= len(looks) <= 12, bounds
    # ... and the alert was sent once for the whole wait; the key waits no more
    assert len([a for a in alerts if a["subject"].startswith("Ordering key waits")]) == 1
    found = get_store(celery_app).order_waits(now=time.time(), limit=10_000)
    assert scoped(stream) not in [w.key for w in found.oldest]


# Faults: the store cut away through a TCP proxy.


def through(proxy: TcpProxy) -> str:
    return REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")


def test_store_cut_at_publish_raises_in_the_caller_and_publishes_nothing(
    celery_app: Any, proxy: TcpProxy, broker: str, queue_name: str, stream: str, sink: Sink
) -> None:
    # Given the publisher's store out of reach
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": through(proxy), "store_timeout": 2.0}
    proxy.cut()
    # Then publishing an ordered task fails in the caller, saying the store is unavailable; nothing is published
    with pytest.raises(StoreUnavailableError, match="unavailable"):
        tasks.ordered_append.delay(stream, 1, sink.key)
    assert waiting_messages(broker, queue_name) == 0
    # And no number was spent: once the store is back, the next message is number 1
    proxy.restore()
    tasks.ordered_append.delay(stream, 1, sink.key)
    message = json.loads(sink.client.lindex(queue_name, 0))
    assert message["headers"]["guardrails"]["ord_seq"] == 1


@pytest.fixture
def cut_worker(celery_app: Any, proxy: TcpProxy, queue_name: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A prefork worker (2 processes) whose store is the test Redis through ``proxy``; the test publishes with
    its own store (direct)."""
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": through(proxy)}))
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env, concurrency=2
    ) as process:
        yield process  # type: ignore[misc]


def test_store_cut_at_run_the_messages_come_back_and_keep_their_order(
    cut_worker: WorkerProcess, proxy: TcpProxy, sink: Sink, stream: str
) -> None:
    # Given the worker's store out of reach as 5 messages of a key are delivered (the last ones first)
    proxy.cut()
    results = [tasks.ordered_append.apply_async((stream, n, sink.key), countdown=(5 - n) * 0.1) for n in range(5)]
    # Then none runs, fails or is dead-lettered: each comes back later
    wait_for("the outage logged", lambda: "the guardrails store is unavailable" in cut_worker.log)
    assert sink.items() == [] and all(r.state in ("PENDING", "RETRY") for r in results)
    # When the store is back
    proxy.restore()
    # Then all run, in order, each on its first attempt; at least one had met the outage
    assert [r.get(timeout=TIMEOUT) for r in results] == [1, 2, 3, 4, 5]
    items = sink.items()
    assert [item["seq"] for item in items] == [1, 2, 3, 4, 5]
    assert {item["attempt"] for item in items} == {1}
    assert any(item["outages"] for item in items)


def test_a_waiter_that_vanished_does_not_hold_the_key_for_ever(
    celery_worker: Any, celery_app: Any, sink: Sink, stream: str, received: Any
) -> None:
    skipped = received(signals.ordering_gap_skipped)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "ordering_gap_timeout": 0.5}
    store = get_store(celery_app)
    # Given numbers 1 and 2 handed out; 1 never published, 2 seen waiting once and then gone (dead-lettered
    # where it could not say so): the key's lowest waiter is 2, and 2 will not come back
    for _ in range(2):
        store.order_next(scoped(stream), now=0.0, retention=3600.0)
    store.order_check(scoped(stream), sequence=2, now=time.time(), retention=3600.0)
    # When 3 is published
    third = tasks.ordered_append.delay(stream, 3, sink.key)
    # Then 3 is not the lowest waiter, so it waits past the timeout; after twice the timeout it gives up 1..2
    assert third.get(timeout=TIMEOUT) == 3
    assert [(s["task_id"], s["first"], s["last"]) for s in skipped] == [(third.id, 1, 2)]
    assert skipped[0]["waited"] >= 1.0
    assert ran(sink) == [3]
