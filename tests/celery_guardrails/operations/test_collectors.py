"""The scrape-time collector (celery_guardrails.operations.collectors) over the real broker, store and a real worker."""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import shared_task
from prometheus_client import CollectorRegistry, generate_latest

from celery_guardrails import GuardedTask
from celery_guardrails.operations.collectors import StateCollector
from celery_guardrails.scheduling.ledger import MISSED, OK
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import BudgetPolicy
from tests.proj import tasks
from tests.support.dead_letters import has_dead_letter
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for

#: Names of this session's own: the shared Redis keeps other tests' dead letters and budgets.
OWNER = f"collector-{uuid.uuid4().hex[:8]}"
DEPENDENCY = f"collector-dep-{uuid.uuid4().hex[:8]}"


@shared_task(base=GuardedTask, bind=True, owner=OWNER, dependency=DEPENDENCY)
def fail_for_collector(self: GuardedTask) -> None:
    raise ValueError("a permanent failure: recorded as a dead letter")


def samples(collector: StateCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in collector.collect()
        for sample in family.samples
    }


def value(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return scraped.get((name, tuple(sorted(labels.items()))))


def test_a_dead_letter_and_a_waiting_message_show_in_the_gauges(
    celery_worker: Any, celery_app: Any, queue_name: str
) -> None:
    # Given a task of OWNER that failed finally (its dead letter recorded by the real worker)
    result = fail_for_collector.delay()
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
    wait_for("the queue drained", lambda: not get_store(celery_app).client.llen(queue_name))  # type: ignore[attr-defined]

    # When the collector is scraped through a registry, as a /metrics endpoint does
    collector = StateCollector(celery_app)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    scraped = samples(collector)

    # Then OWNER has one open dead letter of that task, every source was read, and the queue is there
    assert value(scraped, "celery_guardrails_dead_letters_open", owner=OWNER, task=fail_for_collector.name) == 1
    assert f'celery_guardrails_dead_letters_open{{owner="{OWNER}"' in text
    for source in ("queues", "dead_letters", "dependencies", "schedules"):
        assert value(scraped, "celery_guardrails_collector_source_up", source=source) == 1
    assert value(scraped, "celery_guardrails_queue_depth", queue=queue_name) == 0
    assert value(scraped, "celery_guardrails_queue_oldest_age_known", queue=queue_name) == 1
    # ... and its dependency's circuit is closed, its budget read
    assert value(scraped, "celery_guardrails_circuit_state", dependency=DEPENDENCY, state="closed") == 1
    assert value(scraped, "celery_guardrails_circuit_state", dependency=DEPENDENCY, state="open") == 0
    assert value(scraped, "celery_guardrails_retry_budget_allowed", dependency=DEPENDENCY) is not None


def test_an_unknown_age_is_no_sample_and_says_unknown(broker: str, celery_app: Any, queue_name: str) -> None:
    # Given a queue whose oldest message was published without pub (plain Celery)
    from tests.support.messages import publish_raw

    publish_raw(celery_app, queue_name, "tests.proj.tasks.log_line", args=["raw"])

    # When scraped
    scraped = samples(StateCollector(celery_app))

    # Then its depth is 1, its age is no sample at all (not 0), and known is 0
    assert value(scraped, "celery_guardrails_queue_depth", queue=queue_name) == 1
    assert value(scraped, "celery_guardrails_queue_oldest_age_seconds", queue=queue_name) is None
    assert value(scraped, "celery_guardrails_queue_oldest_age_known", queue=queue_name) == 0


def test_schedule_gauges_read_the_ledger(broker: str, celery_app: Any) -> None:
    # Given a guarded schedule whose ledger has a success, then a missed period after it
    name = f"collector-schedule-{uuid.uuid4().hex[:8]}"
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "schedules": {name: {}}}
    store = get_store(celery_app)
    now = time.time()
    store.run_dispatch(name, now - 7200, task_id="t-ok", now=now - 7200)
    store.run_start(name, now - 7200, task_id="t-ok", now=now - 7200)
    store.run_finish(name, now - 7200, status=OK, now=now - 7190)
    store.run_record(name, now - 3600, status=MISSED, now=now - 3500, reason="test: beat was down")

    # When scraped
    scraped = samples(StateCollector(celery_app))

    # Then one run is missed, none overdue, and the last success is as old as its end (7190 s before the
    # records were written) at least
    assert value(scraped, "celery_guardrails_schedule_missed_runs", schedule=name) == 1
    assert value(scraped, "celery_guardrails_schedule_overdue_runs", schedule=name) == 0
    age = value(scraped, "celery_guardrails_schedule_last_success_age_seconds", schedule=name)
    assert age is not None and age >= 7190


def test_a_scrape_with_the_store_cut_still_returns_the_queues_and_says_which_source_failed(
    broker: str, celery_app: Any, queue_name: str, proxy: TcpProxy
) -> None:
    # Given an app whose store (and dead-letter stream) is the test Redis through a proxy, a message waiting
    # in its queue (the broker is reached directly), and a scrape that reads everything
    store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
    celery_app.conf.guardrails = {"store": store, "dead_letter_sinks": ["redis"], "store_timeout": 2.0}
    tasks.log_line.delay("waiting")
    policy = BudgetPolicy(window=60, ratio=0.2, floor=3, threshold=5, open_seconds=30, probes=1)
    get_store(celery_app).budget_status(DEPENDENCY, policy, now=time.time())  # the store answers
    collector = StateCollector(celery_app)
    before = samples(collector)
    assert value(before, "celery_guardrails_collector_source_up", source="dead_letters") == 1

    # When the store is cut and the collector scraped
    proxy.cut()
    scraped = samples(collector)

    # Then the scrape returns: the queue's gauges are there, the store's sources are down and counted
    assert value(scraped, "celery_guardrails_queue_depth", queue=queue_name) == 1
    assert value(scraped, "celery_guardrails_collector_source_up", source="queues") == 1
    for source in ("dead_letters", "dependencies"):
        assert value(scraped, "celery_guardrails_collector_source_up", source=source) == 0
        assert value(scraped, "celery_guardrails_collector_errors_total", source=source) == 1
    assert not any(name == "celery_guardrails_dead_letters_open" for name, _ in scraped)

    # When the store comes back, the next scrape reads it again
    proxy.restore()
    again = wait_for(
        "the dead letters read again",
        lambda: (
            (s := samples(collector))
            and value(s, "celery_guardrails_collector_source_up", source="dead_letters") == 1
            and s
        ),
    )
    assert value(again, "celery_guardrails_collector_errors_total", source="dead_letters") >= 1  # type: ignore[operator]
