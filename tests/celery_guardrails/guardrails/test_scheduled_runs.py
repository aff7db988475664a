"""Scheduled runs on a real worker: the overlap policies, and the period key as idempotency key.
Real ``celery beat`` (guarded scheduler) and ``celery worker`` processes on a fast clock (see tests/support)."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path
from typing import Any

from celery_guardrails.ledger import OK, SKIPPED_OVERLAP, period_key
from tests.conftest import Sink
from tests.support.scheduling import Rig

TASK = "tests.proj.tasks.scheduled_job"
PERIOD = 10.0  # clock seconds: one real second at speed 10


def overlapping(items: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Pairs of runs whose real [start, end] intervals intersect."""
    spans = sorted((item["real_start"], item["real_end"]) for item in items)
    return [(a[0], b[0]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def slow_schedule(
    tmp_path: Path, rigs: list[Rig], sink: Sink, *, overlap: str, hold: float, periods: int, **settings: Any
) -> tuple[Rig, str]:
    """A task that holds ``hold`` real seconds, every PERIOD, with ``overlap``, on a worker that could run four
    at once; beat stopped once it has handled ``periods`` periods. (rig, entry name)

    The workers' watchdog is off: once beat stops it would record the next periods missed, which these tests
    are not about (tests/celery_guardrails/test_watchdog.py, test_beat.py)."""
    name = f"{overlap}-{uuid.uuid4().hex[:6]}"
    rig = Rig(
        tmp_path,
        entries={name: {"task": TASK, "schedule": PERIOD, "kwargs": {"sink": sink.key, "hold": hold}}},
        policies={name: {"overlap": overlap, "grace": 60}},
        settings={"watchdog": False, **settings},
    )
    rigs.append(rig)
    rig.worker(concurrency=4)
    beat = rig.beat()
    rig.wait(f"{periods} handled periods", lambda: len(rig.runs(name)) >= periods, timeout=60)
    beat.stop()
    return rig, name


def test_overlap_skip_never_runs_two_at_once(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    # Given a task slower than its period (2.5 periods) and a worker that could run four at once
    # When beat dispatches a dozen periods
    rig, name = slow_schedule(tmp_path, rigs, sink, overlap="skip", hold=2.5, periods=12)
    rig.wait("every run finished", lambda: all(r.status in (OK, SKIPPED_OVERLAP) for r in rig.runs(name)), timeout=30)
    # Then the periods that came while one ran are recorded skipped_overlap and did not run the body,
    # and no two runs were ever under way at the same time
    runs = rig.runs(name)
    skipped = [r for r in runs if r.status == SKIPPED_OVERLAP]
    ran = [r for r in runs if r.status == OK]
    assert skipped and ran
    assert all("overlap=skip" in r.reason for r in skipped)
    items = sink.items()
    assert sorted(item["period"] for item in items) == [r.period for r in ran]
    assert overlapping(items) == []


def test_overlap_queue_waits_for_the_previous_run(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    # Given a task a little slower than its period and a worker that could run four at once
    # When beat dispatches five periods
    rig, name = slow_schedule(
        tmp_path, rigs, sink, overlap="queue", hold=1.6, periods=5, retry_later_delay=0.3, retry_later_max=50
    )
    # Then every period runs, none is skipped, and never two at once
    rig.wait("every period ran", lambda: all(r.status == OK for r in rig.runs(name)), timeout=60)
    items = sink.items()
    assert sorted(item["period"] for item in items) == [r.period for r in rig.runs(name)]
    assert overlapping(items) == []


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
    first = rig.wait("a first ok run", lambda: [r for r in rig.runs(name) if r.status == OK])[0]
    beat.stop()
    # Given the period ran: its key reached the task, as self.request.period_key and as its idempotency key
    [report] = sink.items()
    assert report["period"] == first.period
    assert report["period_key"] == period_key(name, first.period)
    assert report["idempotency_key"] == f"{TASK}:-:{period_key(name, first.period)}"
    # When someone runs the same period again by hand (the message a re-run tool would publish)
    celery_app.send_task(
        TASK,
        kwargs={"sink": sink.key},
        queue=rig.queue,
        headers={"guardrails": {"v": 1, "sched": name, "period": round(first.period)}},
    ).get(timeout=30)
    # Then nothing runs again and the ledger record is unchanged
    time.sleep(0.5)
    assert len(sink.items()) == 1
    assert rig.runs(name)[0] == first


def test_overlap_allow_runs_both(tmp_path: Path, rigs: list[Rig], sink: Sink) -> None:
    # Given the same slow task with overlap="allow", and a worker that can run four at once
    # When beat dispatches six periods
    rig, name = slow_schedule(tmp_path, rigs, sink, overlap="allow", hold=2.5, periods=6)
    rig.wait("every period ran", lambda: all(r.status == OK for r in rig.runs(name)), timeout=30)
    # Then every period ran, and runs did overlap
    items = sink.items()
    assert sorted(item["period"] for item in items) == [r.period for r in rig.runs(name)]
    assert overlapping(items)
