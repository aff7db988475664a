"""Both real stores keep the run ledger the same way (Redis: one Lua script per change; Django: an INSERT the
unique constraint refuses, and conditional UPDATEs), including under a real race between two beat processes.

Every scenario runs against Redis and against the Django database (PostgreSQL or SQLite, per
GUARDRAILS_TEST_DB), with the clock given, and checks whole records, not one field.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from celery_guardrails.scheduling.ledger import (
    DISPATCHED,
    FAILED,
    MISSED,
    NAME_MAX_LENGTH,
    OK,
    OPEN,
    OVERDUE,
    REASON_MAX_LENGTH,
    RUNNING,
    SKIPPED_OVERLAP,
    Heads,
    Run,
)
from tests.support.stores import forget, make_store

# The race test forks processes that use the Django store: committed transactions, a real test database.
pytestmark = pytest.mark.django_db(transaction=True)
T0 = 1_800_000_000.0
MINUTE = 60.0


def _forget(kind: str, name: str) -> None:
    """Redis state outlives the test run (the database's is rolled back): drop the schedule's keys."""
    forget(kind, f"*{name}*")


@pytest.fixture
def schedule(kind: str) -> Iterator[str]:
    name = f"tests.ledger.{uuid.uuid4().hex}"  # unique per test: Redis keeps what earlier runs wrote
    yield name
    _forget(kind, name)


def run(schedule: str, period: float, status: str, **fields: Any) -> Run:
    return Run(schedule=schedule, period=period, status=status, **fields)


def test_a_period_is_dispatched_once(store: Any, schedule: str) -> None:
    # Given a period nobody has dispatched
    # When one beat dispatches it, then another (or the same one after a restart)
    first = store.run_dispatch(schedule, T0, task_id="t1", now=T0 + 1)
    second = store.run_dispatch(schedule, T0, task_id="t2", now=T0 + 2)
    # Then only the first dispatch counts, and the record is the first one's
    assert (first, second) == (True, False)
    assert store.run_list(schedule) == [run(schedule, T0, DISPATCHED, task_id="t1", dispatched_at=T0 + 1)]


def test_a_missed_period_without_a_message_is_caught_up_once(store: Any, schedule: str) -> None:
    # Given a period the watchdog recorded as missed (beat was down: no message was sent)
    assert store.run_record(schedule, T0, status=MISSED, now=T0 + 300, reason="beat did not dispatch it") is True
    assert store.run_list(schedule) == [
        run(schedule, T0, MISSED, finished_at=T0 + 300, reason="beat did not dispatch it", missed_at=T0 + 300)
    ]
    # When a catch-up dispatches it, twice
    first = store.run_dispatch(schedule, T0, task_id="catch-up", now=T0 + 400)
    second = store.run_dispatch(schedule, T0, task_id="again", now=T0 + 401)
    # Then it is dispatched once and open again (no end); the reason and the time it was missed are kept
    assert (first, second) == (True, False)
    caught_up = run(
        schedule, T0, DISPATCHED, task_id="catch-up", dispatched_at=T0 + 400, reason="beat did not dispatch it"
    )
    assert store.run_list(schedule) == [replace(caught_up, missed_at=T0 + 300)]
    # When the catch-up is lost too
    again = store.run_transition(schedule, T0, from_=(DISPATCHED,), to=MISSED, now=T0 + 500, reason="lost")
    # Then the record is missed again, but the move answers False: the period was reported missed already
    assert again is False
    assert store.run_list(schedule) == [replace(caught_up, status=MISSED, reason="lost", missed_at=T0 + 300)]


def test_a_missed_period_whose_message_was_sent_is_not_dispatched_again(store: Any, schedule: str) -> None:
    # Given a period that was dispatched, then marked missed because no worker started it within grace
    store.run_dispatch(schedule, T0, task_id="t1", now=T0 + 1)
    assert store.run_transition(
        schedule, T0, from_=(DISPATCHED,), to=MISSED, now=T0 + 300, reason="not started within grace"
    )
    # When a catch-up tries to dispatch it
    # Then it is refused (the message may still be delivered) and the record is unchanged
    assert store.run_dispatch(schedule, T0, task_id="t2", now=T0 + 400) is False
    assert store.run_list(schedule) == [
        run(
            schedule,
            T0,
            MISSED,
            task_id="t1",
            dispatched_at=T0 + 1,
            reason="not started within grace",
            missed_at=T0 + 300,
        )
    ]


def test_a_dispatch_whose_message_was_not_published_is_forgotten(store: Any, schedule: str) -> None:
    # Given a period dispatched as t1 (its publish failed), and another period that started
    store.run_dispatch(schedule, T0, task_id="t1", now=T0 + 1)
    store.run_dispatch(schedule, T0 + MINUTE, task_id="t2", now=T0 + MINUTE)
    store.run_start(schedule, T0 + MINUTE, task_id="t2", now=T0 + MINUTE + 1)
    # When beat forgets them: another id, the right one, the started one
    forgotten = [
        store.run_undispatch(schedule, T0, task_id="other"),
        store.run_undispatch(schedule, T0, task_id="t1"),
        store.run_undispatch(schedule, T0 + MINUTE, task_id="t2"),
    ]
    # Then only the dispatched record of that id is gone: the period is due again, and may be dispatched
    assert forgotten == [False, True, False]
    assert [r.period for r in store.run_list(schedule)] == [T0 + MINUTE]
    assert store.run_dispatch(schedule, T0, task_id="t3", now=T0 + 5) is True


def test_record_inserts_only_when_the_period_has_no_record(store: Any, schedule: str) -> None:
    # Given a period with no record, and one already dispatched
    store.run_dispatch(schedule, T0 + MINUTE, task_id="t1", now=T0 + MINUTE)
    # When the watchdog records both as missed, and the first one once more as skipped
    first = store.run_record(schedule, T0, status=MISSED, now=T0 + 300, reason="beat was down")
    dispatched = store.run_record(schedule, T0 + MINUTE, status=MISSED, now=T0 + 300, reason="beat was down")
    again = store.run_record(schedule, T0, status=SKIPPED_OVERLAP, now=T0 + 301, reason="overlap")
    # Then only the insert into the empty period happened; nothing was overwritten
    assert (first, dispatched, again) == (True, False, False)
    assert store.run_list(schedule) == [
        run(schedule, T0 + MINUTE, DISPATCHED, task_id="t1", dispatched_at=T0 + MINUTE),
        run(schedule, T0, MISSED, finished_at=T0 + 300, reason="beat was down", missed_at=T0 + 300),
    ]


def test_transitions_happen_only_from_the_listed_statuses(store: Any, schedule: str) -> None:
    # Given a dispatched period, and a period with no record at all
    store.run_dispatch(schedule, T0, task_id="t1", now=T0 + 1)
    # When the watchdog tries to move them
    from_running = store.run_transition(schedule, T0, from_=(RUNNING,), to=OVERDUE, now=T0 + 2, reason="late")
    absent = store.run_transition(schedule, T0 + MINUTE, from_=OPEN, to=MISSED, now=T0 + 2, reason="never")
    moved = store.run_transition(schedule, T0, from_=OPEN, to=MISSED, now=T0 + 3, reason="not started")
    twice = store.run_transition(schedule, T0, from_=OPEN, to=MISSED, now=T0 + 4, reason="again")
    # Then only the move from a listed status happened, once; an absent period gets no record
    assert (from_running, absent, moved, twice) == (False, False, True, False)
    assert store.run_list(schedule) == [
        run(schedule, T0, MISSED, task_id="t1", dispatched_at=T0 + 1, reason="not started", missed_at=T0 + 3)
    ]


def test_a_long_reason_is_cut_to_the_maximum(store: Any, schedule: str) -> None:
    # Given a reason longer than the ledger keeps
    reason = "x" * (REASON_MAX_LENGTH + 100)
    # When it is recorded
    store.run_record(schedule, T0, status=MISSED, now=T0, reason=reason)
    # Then the first REASON_MAX_LENGTH characters are kept
    assert [r.reason for r in store.run_list(schedule)] == [reason[:REASON_MAX_LENGTH]]


def test_start_keeps_the_dispatch_time(store: Any, schedule: str) -> None:
    # Given a dispatched period
    store.run_dispatch(schedule, T0, task_id="t1", now=T0 + 1)
    # When a worker starts it
    store.run_start(schedule, T0, task_id="t1", now=T0 + 2.5)
    # Then it is running, with both times
    assert store.run_list(schedule) == [
        run(schedule, T0, RUNNING, task_id="t1", dispatched_at=T0 + 1, started_at=T0 + 2.5)
    ]


def test_start_creates_the_record_when_the_message_came_without_one(store: Any, schedule: str) -> None:
    # Given a period with no record (the message was sent by hand, or by a beat without the ledger)
    # When a worker starts it
    store.run_start(schedule, T0, task_id="manual", now=T0 + 5)
    # Then the record exists, running, with no dispatch time
    assert store.run_list(schedule) == [run(schedule, T0, RUNNING, task_id="manual", started_at=T0 + 5)]


def test_finish_records_the_outcome(store: Any, schedule: str) -> None:
    # Given three started periods, one of which ran past its maximum run time
    for period in (T0, T0 + MINUTE, T0 + 2 * MINUTE):
        store.run_dispatch(schedule, period, task_id=f"t{period:.0f}", now=period)
        store.run_start(schedule, period, task_id=f"t{period:.0f}", now=period + 1)
    store.run_transition(schedule, T0 + 2 * MINUTE, from_=(RUNNING,), to=OVERDUE, now=T0 + 150, reason="ran 30s")
    # When they finish: ok, failed with a reason, ok with none
    store.run_finish(schedule, T0, status=OK, now=T0 + 10)
    store.run_finish(schedule, T0 + MINUTE, status=FAILED, now=T0 + MINUTE + 10, reason="PermanentError: gone")
    store.run_finish(schedule, T0 + 2 * MINUTE, status=OK, now=T0 + 2 * MINUTE + 40)

    # Then each record has its end and status; the overdue one keeps when and why it was overdue
    def started(period: float, status: str, **fields: Any) -> Run:
        return run(
            schedule, period, status, task_id=f"t{period:.0f}", dispatched_at=period, started_at=period + 1, **fields
        )

    assert store.run_list(schedule) == [
        started(
            T0 + 2 * MINUTE,
            OK,
            finished_at=T0 + 2 * MINUTE + 40,
            reason="finished after being overdue: ran 30s",
            overdue_at=T0 + 150,
        ),
        started(T0 + MINUTE, FAILED, finished_at=T0 + MINUTE + 10, reason="PermanentError: gone"),
        started(T0, OK, finished_at=T0 + 10),
    ]


def test_finish_creates_the_record_when_absent(store: Any, schedule: str) -> None:
    # Given a period with no record
    # When a worker skips it because its predecessor is still running
    store.run_finish(schedule, T0, status=SKIPPED_OVERLAP, now=T0 + 1, reason="previous run still running")
    # Then the record says so
    assert store.run_list(schedule) == [
        run(schedule, T0, SKIPPED_OVERLAP, finished_at=T0 + 1, reason="previous run still running")
    ]


def test_list_is_newest_first_and_filters(store: Any, schedule: str, kind: str) -> None:
    # Given six periods a minute apart, alternately dispatched and missed, and another schedule's record
    periods = [T0 + i * MINUTE for i in range(6)]
    for i, period in enumerate(periods):
        if i % 2:
            store.run_record(schedule, period, status=MISSED, now=period, reason="beat was down")
        else:
            store.run_dispatch(schedule, period, task_id=f"t{i}", now=period)
    other = f"{schedule}.other"
    try:
        store.run_dispatch(other, T0, task_id="other", now=T0)

        def listed(**options: Any) -> list[float]:
            return [r.period for r in store.run_list(schedule, **options)]

        # When they are listed, Then newest come first, and each filter applies
        assert listed() == periods[::-1]
        assert listed(statuses=(MISSED,)) == [periods[5], periods[3], periods[1]]
        assert listed(statuses=(DISPATCHED, MISSED), limit=4) == periods[:1:-1]
        assert listed(before=periods[3]) == [periods[2], periods[1], periods[0]]  # strictly before
        assert listed(statuses=(DISPATCHED,), before=periods[4], limit=1) == [periods[2]]
        assert listed(statuses=(OK,)) == []
        assert listed(limit=0) == []
        assert [r.schedule for r in store.run_list(other)] == [other]
    finally:
        _forget(kind, other)


def test_the_heads_of_many_schedules_are_read_at_once(
    store: Any, schedule: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "django":
        from django_celery_guardrails.store import ledger

        # (500 schedules a query in the Django store; 50 here, so that 52 schedules span two chunks)
        monkeypatch.setattr(ledger, "HEADS_CHUNK", 50)
    # Given 52 schedules (more than one chunk of the Django store; their keys go with the test's schedule): each
    # with an old ok record and a newer one; every tenth of them also running an earlier period
    names = [f"{schedule}.{n:04d}" for n in range(52)]
    for n, name in enumerate(names):
        store.run_dispatch(name, T0, task_id=f"old-{n}", now=T0)
        store.run_finish(name, T0, status=OK, now=T0 + 1)
        if n % 10 == 0:
            store.run_dispatch(name, T0 + MINUTE, task_id=f"long-{n}", now=T0 + MINUTE)
            store.run_start(name, T0 + MINUTE, task_id=f"long-{n}", now=T0 + MINUTE + 1)
        store.run_dispatch(name, T0 + 2 * MINUTE, task_id=f"new-{n}", now=T0 + 2 * MINUTE)
    # When their heads are read, with a name twice and a schedule never run
    heads = store.run_heads([*names, names[0], f"{schedule}.never"])
    # Then each has its newest period and its records still dispatched or running, newest first
    assert len(heads) == 53
    assert heads[f"{schedule}.never"] == Heads()
    assert heads[names[5]] == Heads(
        newest_period=T0 + 2 * MINUTE,
        pending=(run(names[5], T0 + 2 * MINUTE, DISPATCHED, task_id="new-5", dispatched_at=T0 + 2 * MINUTE),),
    )
    running = heads[names[50]].pending
    assert [(r.period, r.status, r.task_id) for r in running] == [
        (T0 + 2 * MINUTE, DISPATCHED, "new-50"),
        (T0 + MINUTE, RUNNING, "long-50"),
    ]
    assert {h.newest_period for h in map(heads.get, names)} == {T0 + 2 * MINUTE}
    assert [h.pending[0].task_id for h in map(heads.get, names)] == [f"new-{n}" for n in range(52)]
    # And the pending records are cut at the limit asked for
    assert store.run_heads([names[50]], limit=1)[names[50]].pending == running[:1]


def test_a_name_with_spaces_and_the_maximum_length(store: Any, kind: str) -> None:
    # Given a django-celery-beat style name: spaces, 200 characters
    name = f"Nightly report for {uuid.uuid4().hex} ".ljust(NAME_MAX_LENGTH, "z")
    assert len(name) == NAME_MAX_LENGTH
    try:
        # When it is dispatched twice and started
        first = store.run_dispatch(name, T0, task_id="t1", now=T0)
        second = store.run_dispatch(name, T0, task_id="t2", now=T0)
        store.run_start(name, T0, task_id="t1", now=T0 + 1)
        # Then it behaves like any name, and comes back whole
        assert (first, second) == (True, False)
        assert store.run_list(name) == [run(name, T0, RUNNING, task_id="t1", dispatched_at=T0, started_at=T0 + 1)]
    finally:
        _forget(kind, name)


def test_a_refused_dispatch_leaves_the_callers_transaction_usable() -> None:
    from django.db import transaction

    from django_celery_guardrails.models import ScheduledRun
    from django_celery_guardrails.store import DjangoStore

    # Given a Django store used inside the caller's own transaction, and a period already dispatched
    store, name = DjangoStore(), f"tests.ledger.{uuid.uuid4().hex}"
    store.run_dispatch(name, T0, task_id="t1", now=T0)
    with transaction.atomic():
        # When a second dispatch and a second record are refused by the unique constraint
        assert store.run_dispatch(name, T0, task_id="t2", now=T0) is False
        assert store.run_record(name, T0, status=MISSED, now=T0, reason="late") is False
        store.run_finish(name, T0, status=OK, now=T0 + 1)
        # Then the transaction goes on: the next query works
        assert ScheduledRun.objects.of(name).get().status == OK
    assert ScheduledRun.objects.of(name).open().count() == 0


def _contender(kind: str, schedule: str, periods: list[float], barrier: Any, results: Any, name: str) -> None:
    if kind == "django":
        from django.db import connections

        connections.close_all()  # never share the parent's connection across fork
    store = make_store(kind)
    wins = []
    for period in periods:
        barrier.wait()
        wins.append(store.run_dispatch(schedule, period, task_id=f"{name}-{period:.0f}", now=time.time()))
    results.put((name, wins))


def test_two_beats_dispatching_the_same_periods_at_the_same_moment_200_times(kind: str, schedule: str) -> None:
    # Given 200 periods and two beat processes that meet at a barrier before dispatching each one
    periods = [T0 + i * MINUTE for i in range(200)]
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    if kind == "django":
        from django.db import connections

        connections.close_all()
    processes = [
        context.Process(target=_contender, args=(kind, schedule, periods, barrier, results, f"p{i}")) for i in (1, 2)
    ]
    for process in processes:
        process.start()
    outcome = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(30)
    # Then every period was dispatched by exactly one of them, and its record names that one's message
    assert [a + b for a, b in zip(outcome["p1"], outcome["p2"], strict=True)] == [1] * len(periods)
    assert 0 < sum(outcome["p1"]) < len(periods)  # both won some: they really raced
    winners = {period: "p1" if won else "p2" for period, won in zip(periods, outcome["p1"], strict=True)}
    records = make_store(kind).run_list(schedule, limit=1000)
    assert [(r.period, r.task_id) for r in records] == [(p, f"{winners[p]}-{p:.0f}") for p in reversed(periods)]
