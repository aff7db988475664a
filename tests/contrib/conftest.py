"""Fixtures of the contrib tests: a real in-process worker with metrics on, and a real scrape of it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import shared_task

from celery_guardrails import GuardedTask
from tests.contrib.exported import Scrape, scrape
from tests.support.dead_letters import has_dead_letter
from tests.support.waiting import wait_for

#: This session's own owner and dependency: the shared Redis keeps other tests' dead letters and budgets.
OWNER = f"contrib-{uuid.uuid4().hex[:8]}"
DEPENDENCY = f"contrib-dep-{uuid.uuid4().hex[:8]}"


@shared_task(base=GuardedTask, bind=True, owner=OWNER, dependency=DEPENDENCY)
def contrib_fails(self: GuardedTask) -> None:
    raise ValueError("a final failure: recorded as a dead letter")


@shared_task(base=GuardedTask, bind=True, dependency=DEPENDENCY)
def contrib_succeeds(self: GuardedTask) -> str:
    return "done"


@pytest.fixture
def celery_config(celery_config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    # The suite's configuration, with the metrics recorded.
    yield {**celery_config, "guardrails": {**celery_config["guardrails"], "metrics": True}}


def _completed(scraped: Scrape, task: str) -> bool:
    return any(
        sample.name == "celery_guardrails_messages_completed_total" and sample.labels.get("task") == task
        for sample in scraped.samples
    )


@pytest.fixture
def real_scrape(celery_worker: Any, celery_app: Any, transactional_db: Any) -> Scrape:
    """A scrape after a real worker ran a task that succeeded and one that was dead-lettered (so that every
    worker-side family and every state gauge has samples). The Django app is installed in the test process: the
    scrape reads its outbox too (empty), as a Django project's would."""
    ok = contrib_succeeds.delay()
    failed = contrib_fails.delay()
    assert ok.get(timeout=60) == "done"
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, failed.id))
    # The counters are recorded after the result is stored: wait until both deliveries are counted.
    return wait_for(
        "both deliveries counted",
        lambda: (
            scraped
            if _completed(scraped := scrape(celery_app), contrib_succeeds.name)
            and _completed(scraped, contrib_fails.name)
            else None
        ),
    )
