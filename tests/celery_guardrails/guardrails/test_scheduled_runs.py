"""Scheduled runs on a real worker: the overlap policies, and the period key as idempotency key.
Real ``celery beat`` (guarded scheduler) and ``celery worker`` processes on a clock the test moves (see
tests/support/scheduling.py)."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails.guardrails.scheduled_runs import slot_key
from celery_guardrails.runtime.effects import provider_key
from celery_guardrails.scheduling.ledger import DISPATCHED, OK, RUNNING, SKIPPED_OVERLAP, period_key
from tests.conftest import Sink
from tests.support.scheduling import Rig
from tests.support.workers import proj_env

TASK = "tests.proj.tasks.scheduled_job"
PERIOD = 10.0  # seconds of the rig's clock, which moves only when the test moves it


def overlapping(items: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Pairs of runs whose real [start, end] intervals intersect."""
    spans = sorted((item["real_start"], item["real_end"]) for item in items)
    return [(a[0], b[0]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def log_lines(process: Any, text: str) -> list[str]:
    return [line for line in process.log.splitlines() if text in line]


class Gated:
    """An entry every PERIOD whose runs wait on a gate (a Redis list) until the test opens it, on a worker
    that could run four at once; beat is looking at it. The clock moves only when the test moves it, so
    which period comes while another runs is the test's choice, not the machine's speed.

    The workers' watchdog is off: these tests are not about missed periods (test_watchdog.py, test_beat.py)."""

    def __init__(
        self, tmp_path: Path, rigs: list[Rig], sink: Sink, *, overlap: str, django: bool = False, **settings: Any
    ) -> None:
        self.name = f"{overlap}-{uuid.uuid4().hex[:6]}"
        self.gate = f"{sink.key}:gate"
        store = None
        if django:  # the Django store, on the test database (the caller is a django_db test)
            from django_celery_guardrails.store import DjangoStore

            store, settings = DjangoStore(), {**settings, "store": "django"}
        self.rig = Rig(
            tmp_path,
            entries={self.name: {"task": TASK, "schedule": PERIOD, "kwargs": {"sink": sink.key, "gate": self.gate}}},
            policies={self.name: {"overlap": overlap, "grace": 60}},
            settings={"watchdog": False, **settings},
            store=store,
        )
        if django:
            self.rig.env.update(proj_env(queue=self.rig.queue, django=True))
        rigs.append(self.rig)
        self.worker = self.rig.worker(concurrency=4)
        self.beat = self.rig.beat()
        self.rig.looking(self.beat, self.name)
        self.sink = sink

    def next_period(self) -> float:
        """Move the clock past the next period; that period."""
        period = self.rig.now() - self.rig.now() % PERIOD + PERIOD
        self.rig.set_clock(period + 1)
        return period

    def wait_status(self, period: float, *statuses: str) -> None:
        self.rig.wait(f"{period} {'/'.join(statuses)}", lambda: self.status(period) in statuses)

    def status(self, period: float) -> str | None:
        run = self.rig.run_of(self.name, period)
        return None if run is None else run.status

    def open_gate(self, runs: int = 1) -> None:
        self.sink.client.rpush(self.gate, *["go"] * runs)

    def slot_lease(self) -> float | None:
        """Until when the schedule's run slot is held (None: not held)."""
        held = self.rig.store.inspect(slot_key(self.name))
        if not held or held.get("state") != "claimed":
            return None
        until = held["lease_until"]
        return until.timestamp() if hasattr(until, "timestamp") else float(until)


def overlap_skip_outlives_the_lease(job: Gated, lease: float) -> None:
    """A run held for over three leases keeps the slot: the next period is skipped, never run alongside."""
    # Given a run under way, its slot renewed by the heartbeat for over three of its leases
    one = job.next_period()
    job.wait_status(one, RUNNING)
    first = job.rig.wait("the slot held", job.slot_lease)
    job.rig.wait("three leases of heartbeats", lambda: (job.slot_lease() or 0) >= first + 3 * lease)
    # When the next period comes
    two = job.next_period()
    # Then it is skipped: the slot was still held
    job.wait_status(two, SKIPPED_OVERLAP)
    job.open_gate()
    job.wait_status(one, OK)
    assert overlapping(job.sink.items()) == []


def test_overlap_skip_holds_the_slot_for_a_run_longer_than_its_lease(
    tmp_path: Path, rigs: list[Rig], sink: Sink
) -> None:
    overlap_skip_outlives_the_lease(Gated(tmp_path, rigs, sink, overlap="skip", idempotency_lease=1.5), 1.5)


def test_overlap_skip_never_runs_two_at_once(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    job = Gated(tmp_path, rigs, sink, overlap="skip")
    # Given a run under way
    one = job.next_period()
    job.wait_status(one, RUNNING)
    # When two more periods come while it runs
    two, three = job.next_period(), job.next_period()
    # Then they are recorded skipped_overlap without running the body
    job.wait_status(two, SKIPPED_OVERLAP)
    job.wait_status(three, SKIPPED_OVERLAP)
    # When the run ends, the next period runs again
    job.open_gate()
    job.wait_status(one, OK)
    four = job.next_period()
    job.open_gate()
    job.wait_status(four, OK)
    runs = {r.period: r for r in job.rig.runs(job.name)}
    assert {p: r.status for p, r in runs.items()} == {one: OK, two: SKIPPED_OVERLAP, three: SKIPPED_OVERLAP, four: OK}
    assert all("overlap=skip" in runs[p].reason for p in (two, three))
    items = sink.items()
    assert [item["period"] for item in items] == [one, four]
    assert overlapping(items) == []


def test_overlap_queue_waits_for_the_previous_run(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    job = Gated(tmp_path, rigs, sink, overlap="queue", retry_later_delay=0.3, retry_later_max=200)
    # Given a run under way
    one = job.next_period()
    job.wait_status(one, RUNNING)
    # When two more periods come while it runs
    two, three = job.next_period(), job.next_period()
    job.wait_status(two, DISPATCHED)
    job.wait_status(three, DISPATCHED)

    def waiting() -> list[str]:
        return log_lines(job.worker, "the previous run is still going (overlap=queue)")

    for period in (two, three):
        task_id = job.rig.run_of(job.name, period).task_id  # type: ignore[union-attr]
        job.rig.wait(f"{period} waiting", lambda task_id=task_id: any(f"[{task_id}]" in line for line in waiting()))
    # Then each waits for the one before, and runs once it has ended: never two at once, none skipped
    job.open_gate(3)
    for period in (one, two, three):
        job.wait_status(period, OK)
    items = sink.items()
    assert sorted(item["period"] for item in items) == [one, two, three]
    assert [r.status for r in job.rig.runs(job.name)] == [OK, OK, OK]
    assert overlapping(items) == []


@pytest.mark.smoke
def test_the_period_key_makes_a_rerun_of_the_same_period_a_duplicate(
    tmp_path: Path, rigs: list[Rig], sink: Sink, celery_app: Any
) -> None:
    name = f"rerun {uuid.uuid4().hex[:6]}"  # a space, as django-celery-beat names often have
    rig = Rig(
        tmp_path,
        entries={name: {"task": TASK, "schedule": 60.0, "kwargs": {"sink": sink.key}}},
        policies={name: {"grace": 30}},
    )
    rigs.append(rig)
    rig.worker()
    beat = rig.beat()
    rig.looking(beat, name)
    rig.set_clock(rig.now() + 60 + 1)
    first = rig.wait("a first ok run", lambda: [r for r in rig.runs(name) if r.status == OK])[0]
    beat.stop()
    # Given the period ran: its key reached the task, as self.request.period_key and as its idempotency key
    [report] = sink.items()
    assert report["period"] == first.period
    assert report["period_key"] == period_key(name, first.period)
    assert report["idempotency_key"] == provider_key(f"{TASK}:-:{period_key(name, first.period)}")
    # When someone runs the same period again by hand (the message a re-run tool would publish)
    celery_app.send_task(
        TASK,
        kwargs={"sink": sink.key},
        queue=rig.queue,
        headers={"guardrails": {"v": 1, "sched": name, "period": round(first.period)}},
    ).get(timeout=30)
    # Then nothing runs again and the ledger record is unchanged
    assert len(sink.items()) == 1
    assert rig.runs(name)[0] == first


def test_overlap_allow_runs_both(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    job = Gated(tmp_path, rigs, sink, overlap="allow")
    # Given a run under way
    one = job.next_period()
    job.wait_status(one, RUNNING)
    # When the next period comes while it runs
    two = job.next_period()
    # Then it runs too, at the same time
    job.wait_status(two, RUNNING)
    assert job.status(one) == RUNNING
    job.open_gate(2)
    job.wait_status(one, OK)
    job.wait_status(two, OK)
    assert len(overlapping(sink.items())) == 1
