"""Waiting work made visible (celery_guardrails.guardrails.waiting) on a real worker and broker, the Redis store: a
retry
waiting for its countdown and a delivery deferred by the retry budget are listed by ``status`` with their
reason, attempt and due time while they wait, and leave the list once they run; a waiting row that cannot be
written costs the retry nothing.

The Django store and the admin page: tests/django_app/test_waiting.py.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_guardrails.guardrails import waiting
from celery_guardrails.operations import status
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import Wait
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.private_redis import PrivateRedis
from tests.support.waiting import wait_for

TIMEOUT = 60


def row_of(app: Any, task_id: str) -> Wait | None:
    """The waiting row of ``task_id``, as the store lists it (None: not waiting)."""
    found = get_store(app).waiting(now=time.time(), limit=10_000)
    return next((row for row in found.soonest if row.task_id == task_id), None)


def listed(app: Any, task_id: str) -> status.WaitingMessage | None:
    """``task_id`` as ``celery -A proj guardrails status`` reads it (None: not listed)."""
    found = status.gather(app).waiting
    assert found is not None
    return next((row for row in found.soonest if row.task_id == task_id), None)


@pytest.fixture
def own_store(celery_app: Any, tmp_path: Path) -> Any:
    """A store of the test's own: ``status`` lists the soonest waits only, and other tests' waits in the shared
    store could push this test's out of that list."""
    server = PrivateRedis(workdir=tmp_path / "store").start()
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": server.url}
    try:
        yield server
    finally:
        server.kill()


def test_a_retry_then_a_budget_deferral_are_listed_while_they_wait_and_leave_once_it_runs(
    own_store: PrivateRedis, celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given a dependency whose retry budget allows no retry, and retries waiting 3 s (the jitter's draw fixed)
    dependency = f"dep-{uuid.uuid4().hex[:8]}"
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "retry_budget_floor": 0,
        "retry_budget_ratio": 0.0,
        "retry_budget_window": 60.0,
        "circuit_threshold": 0,
        "retry_budget_max_deferrals": 50,
        "backoff_random": lambda: 1.0,
    }
    # When a task of it fails once (transient), then would succeed
    started = time.time()
    result = tasks.behave.apply_async(
        (sink.key, ["transient", "ok"]), dependency=dependency, backoff_base=3.0, backoff_max=3.0
    )

    # Then it is first listed as a retry after its error, for attempt 2, due about 3 s after its failure
    retry = wait_for("the retry listed", lambda: listed(celery_app, result.id))
    assert (retry.task, retry.tenant, retry.reason, retry.detail) == (
        "tests.proj.tasks.behave",
        "",
        "retry",
        "TransientError",
    )
    assert (retry.reason_text, retry.attempt, retry.overdue) == ("retry after TransientError", 2, False)
    assert started + 2.9 <= retry.due <= time.time() + 3.1
    assert started <= retry.since <= retry.due - 2.9
    assert retry.due_text.startswith("in ")
    text = status.render(status.gather(celery_app))
    assert "Waiting (re-published with a countdown" in text
    # (a column: other tests' waits in the shared store may widen it)
    assert re.search(rf"tests\.proj\.tasks\.behave +{result.id}", text)
    # And, its retry denied by the spent budget, it is listed as deferred by the budget, still for attempt 2
    deferred = wait_for(
        "the deferral listed", lambda: (r := listed(celery_app, result.id)) and r.reason == "budget" and r
    )
    assert (deferred.reason_text, deferred.detail, deferred.attempt) == (f"budget {dependency}", dependency, 2)
    assert deferred.due > retry.due
    assert [r["step"] for r in sink.items()] == ["transient"]  # deferred: the body did not run again

    # When the budget allows retries again, Then it runs (attempt 2) and is no longer listed
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "retry_budget_floor": 100}
    assert result.get(timeout=TIMEOUT)["attempt"] == 2
    assert row_of(celery_app, result.id) is None
    assert [(r["step"], r["attempt"]) for r in sink.items()] == [("transient", 1), ("ok", 2)]
    # And the history says the same sequence: the failure, the deferral(s), then the run
    history = result.get()["history"]
    assert history[0]["class"] == "transient"
    assert {r["class"] for r in history[1:]} == {"deferred_budget"}


def test_a_task_deferred_many_times_is_one_row_waiting_since_its_first_deferral(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given a task that asks to be delivered again later (RetryLater) three times, 0.5 s each, then succeeds
    result = tasks.behave.apply_async((sink.key, ["later:0.5", "later:0.5", "later:0.5", "ok"]))
    first = wait_for("the first wait listed", lambda: row_of(celery_app, result.id))
    # When it waits again and again, Then it stays one row whose "since" is the first wait's
    seen = {first.due}
    while not result.ready():
        row = row_of(celery_app, result.id)
        if row is not None:
            seen.add(row.due)
            assert (row.reason, row.detail, row.attempt) == ("later", "not readable yet", 1)
            assert row.since == pytest.approx(first.since, abs=0.01)
        time.sleep(0.02)
    assert len(seen) >= 2  # (a later wait was seen with its own due time)
    # And once it ran, it is not listed
    assert result.get(timeout=TIMEOUT)["run"] == 4
    assert row_of(celery_app, result.id) is None


@pytest.fixture
def broken_waiting_store(celery_app: Any, tmp_path: Path) -> Any:
    """A store of the test's own whose waiting hash cannot be written: its key holds a string (WRONGTYPE)."""
    server = PrivateRedis(workdir=tmp_path / "store").start()
    server.client().set("guardrails:{waiting}", "not a hash")
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": server.url, "backoff_random": lambda: 1.0}
    try:
        yield server
    finally:
        server.kill()


def test_a_waiting_row_that_cannot_be_written_costs_the_retry_nothing(
    broken_waiting_store: PrivateRedis, celery_worker: Any, celery_app: Any, sink: Sink, caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_guardrails.guardrails.waiting")
    # When a task fails once (transient) and its wait cannot be written (nor removed as it runs again)
    result = tasks.behave.apply_async((sink.key, ["transient", "ok"]), backoff_base=0.5, backoff_max=0.5)

    # Then the retry was published all the same and ran: attempt 2 succeeded
    assert result.get(timeout=TIMEOUT)["attempt"] == 2
    assert [(r["step"], r["attempt"]) for r in sink.items()] == [("transient", 1), ("ok", 2)]
    # And each failure is one warning, with the task's id, and no traceback
    warnings = [
        r for r in caplog.records if r.name == "celery_guardrails.guardrails.waiting" and result.id in r.getMessage()
    ]
    assert [r.getMessage().split(" (")[0] for r in warnings] == [
        f"Task tests.proj.tasks.behave[{result.id}]: its wait is not shown",
        f"Task tests.proj.tasks.behave[{result.id}]: its waiting row was not removed",
    ]
    assert all(r.exc_info is None and "WRONGTYPE" in r.getMessage() for r in warnings)
    # And the status says it could not read the waits, and reads the rest
    read = status.gather(celery_app)
    assert "WRONGTYPE" in read.errors[status.WAITING]
    assert "could not be read" in status.render(read)


def test_in_words_and_due_read_as_people_say_them() -> None:
    # Given a wait due at 1 000 000 s, When it is read at several moments, Then the due time reads as said
    row = Wait(
        task_id="t", task_name="n", reason="circuit", detail="payments-api", due=1_000_000.0, since=0, expires=2e6
    )
    said = [waiting.due_in_words(row, 1_000_000.0 - ahead) for ahead in (250, 45, 0, -299, -420, -3 * 3600)]
    assert said == ["in 4 min", "in 45 s", "now", "now", "overdue 7 min", "overdue 3 h"]
    assert waiting.label(row) == "circuit payments-api"
    pending = Wait(task_id="t", task_name="n", reason="dead_letter", due=0, since=0, expires=0)
    assert waiting.label(pending) == "dead letter not yet recorded"
