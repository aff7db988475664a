"""The activity on the Django store under PostgreSQL: processes flushing at the same moment (a prefork worker's
children, each with its own recorder) add their counts to the same rows without deadlocking one another, and
no count is lost or added twice: two forked recorders released together, and a real ``celery worker --pool
prefork -c 2`` flushing every 0.2 s."""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.db import connection, connections

from celery_guardrails.operations import activity
from tests.support.services import BROKER_URLS, REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

pytestmark = pytest.mark.django_db(transaction=True)
#: Keys (task, outcome) of one minute that both processes count: every row is written by both.
KEYS = 240
#: Flushes each process makes, the two released together each time.
ROUNDS = 4
#: Seconds a process waits for the other at the start of a round (a process that died, not a measure).
BOUND = 60.0


class _Errors(logging.Handler):
    """The activity's failed-flush log lines of this process (what a worker's log would show)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.getMessage():
            self.lines.append(record.getMessage())


def _flushing_child(keys: list[tuple[str, str]], base: float, barrier: Any, results: Any) -> None:
    """A pool child's recorder: counts ``keys`` in the order given, then flushes as the other child does."""
    errors = _Errors()
    logging.getLogger(activity.__name__).addHandler(errors)
    # (Its own flushing thread would flush once an hour: every flush here is the test's.)
    app = Celery(f"activity-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.guardrails = {"store": "django", "activity_flush_interval": 3600.0, "clock": lambda: base + 1}
    recorder = activity.Recorder(app)
    landed = []
    try:
        for _ in range(ROUNDS):
            for task, outcome in keys:
                recorder.count(task, "q", outcome)
            barrier.wait(BOUND)
            landed.append(recorder.flush())
        # What a refused flush kept is sent again (as the next interval would) until it lands.
        for _ in range(10):
            if not recorder.pending():
                break
            recorder.flush()
        results.put({"landed": landed, "errors": errors.lines, "pending": recorder.pending()})
    except BaseException as exc:
        results.put({"landed": landed, "errors": [*errors.lines, repr(exc)], "pending": recorder.pending()})
    finally:
        connections.close_all()


def test_children_flushing_together_in_opposite_orders_never_deadlock_and_lose_no_count() -> None:
    from django_celery_guardrails.store import DjangoStore

    if connection.vendor != "postgresql":
        pytest.skip("row locks taken one by one: runs in the PostgreSQL pass (SQLite locks the whole database)")
    # Given two processes (a prefork worker's two children) that counted the same 240 keys of one minute in
    # opposite orders (the order each saw its deliveries end), and flush at the same moment, 4 rounds
    base = float(978_307_200 + random.randrange(0, 90_000) * 3600 + 600)
    prefix = f"tests.activity.{uuid.uuid4().hex[:8]}"
    keys = [(f"{prefix}.task{n // 3:03d}", ("succeeded", "retried", "dead_lettered")[n % 3]) for n in range(KEYS)]
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    connections.close_all()  # a child must not share this process's connection (it opens its own)
    children = [
        context.Process(target=_flushing_child, args=(order, base, barrier, results))
        for order in (keys, list(reversed(keys)))
    ]
    for child in children:
        child.start()
    found = [results.get(timeout=BOUND * ROUNDS) for _ in children]
    for child in children:
        child.join(BOUND)
    # Then no flush failed: no "deadlock detected", every round's batch landed at once, nothing left unsent
    assert [(report["errors"], report["landed"], report["pending"]) for report in found] == [
        ([], [True] * ROUNDS, 0)
    ] * 2
    # And each key of the minute holds both processes' counts of every round: none lost, none added twice
    outcomes = DjangoStore().activity_read(since=base, until=base + 60).outcomes
    counted = Counter({(o.task, o.outcome): o.count for o in outcomes if o.task.startswith(prefix)})
    assert counted == Counter({key: 2 * ROUNDS for key in keys})


#: The real worker's case: its tasks and queues (every (task, queue) pair is one row of the minute, counted by both
#: children), and how many deliveries of each pair.
WORKER_TASKS = ("tests.proj.tasks.observe", "tests.proj.tasks.log_line")
WORKER_QUEUES = 15
PER_KEY = 15


@pytest.mark.timeout(120)  # a Django worker starts and stops; 450 deliveries on two shared cores
def test_a_prefork_worker_s_two_children_flushing_the_same_rows_never_deadlock_and_count_each_delivery_once(
    tmp_path: Path,
) -> None:
    from django_celery_guardrails.store import DjangoStore

    if connection.vendor != "postgresql":
        pytest.skip("row locks taken one by one: runs in the PostgreSQL pass (SQLite locks the whole database)")
    # Given 450 deliveries of 2 tasks waiting on 15 queues in a random order: 30 rows of one minute (or two)
    stamp = uuid.uuid4().hex[:8]
    queues = [f"gr-test-activity-{stamp}-{n:02d}" for n in range(WORKER_QUEUES)]
    keys = [(task, queue) for task in WORKER_TASKS for queue in queues] * PER_KEY
    random.shuffle(keys)
    app = Celery(f"activity-{stamp}", set_as_current=False)
    app.conf.update(broker_url=BROKER_URLS["redis"], result_backend=REDIS_URL)
    since = time.time() - 60
    results = [
        app.send_task(task, args=("activity",) if task.endswith("log_line") else (), queue=queue)
        for task, queue in keys
    ]
    # and a real prefork worker with two children on the Django store (PostgreSQL), the activity on, each child
    # adding its counts every 0.2 s (their flushing threads start with their first deliveries, together)
    guardrails = {"store": "django", "activity": True, "activity_flush_interval": 0.2}
    env = proj_env(queue=queues[0], django=True, GUARDRAILS_TEST_GUARDRAILS=json.dumps(guardrails))
    worker = WorkerProcess(
        app=PROJ_APP, queue=",".join(queues), log_path=tmp_path / "worker.log", env=env, concurrency=2
    )
    try:
        with worker:
            # When both children run them, each counting the rows in the order its deliveries happened to end and
            # flushing them while the other does
            wait_for("every delivery ended", lambda: all(result.ready() for result in results), timeout=90)
            # (and the worker is stopped as a deployment stops it, SIGTERM to its main process: each child adds
            # what it counted since its last flush as it exits. A SIGTERM to the children themselves lands in
            # a child as a SystemExit, which can fall after a delivery's result and before its count: a CI run
            # lost one delivery's count that way)
            worker.stop(30, group=False)
        # Then no flush was refused: no "deadlock detected", no batch kept for later
        assert "deadlock detected" not in worker.log
        assert "Activity: adding" not in worker.log
        # And each row holds exactly its deliveries: none lost, none added twice
        outcomes = DjangoStore().activity_read(since=since, until=time.time() + 60).outcomes
        counted: Counter[tuple[str, str, str]] = Counter()
        for outcome in outcomes:
            if outcome.queue in queues:
                counted[(outcome.task, outcome.queue, outcome.outcome)] += outcome.count
        assert counted == Counter({(task, queue, "succeeded"): PER_KEY for task in WORKER_TASKS for queue in queues})
    finally:
        app.close()
