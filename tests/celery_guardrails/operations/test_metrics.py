"""Metrics on real workers: outcomes, durations and queue waits as recorded, scraped from the worker's own HTTP
endpoint (solo, threads, and prefork children summed through PROMETHEUS_MULTIPROC_DIR), over Redis and RabbitMQ;
nothing recorded with ``metrics`` off; a recording failure never fails the task."""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.operations import metrics
from celery_guardrails.options import validate
from tests.conftest import BOTH_BROKERS, Sink
from tests.proj import tasks
from tests.support.messages import publish_raw
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

#: Bucket bounds of the tests: a 0.2 s sleep is above 0.2 (a sleep is never shorter than asked) and well below 5.
BUCKETS = [0.1, 0.2, 5.0, 60.0]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample the worker's endpoint serves now, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def buckets(samples: Samples, name: str, **labels: str) -> list[float]:
    """The cumulative bucket counts of a histogram, in bound order (+Inf last)."""
    bounds = [*(repr(float(b)) for b in BUCKETS), "+Inf"]
    return [value(samples, f"{name}_bucket", **labels, le=bound) for bound in bounds]


def worker(
    tmp_path: Path,
    queue: str,
    *,
    broker: str = "redis",
    pool: str = "solo",
    concurrency: int = 1,
    port: int | None = None,
    name: str = "worker",
    extra: tuple[str, ...] = (),
    **env: str,
) -> WorkerProcess:
    settings = {"metrics": True, "metrics_buckets": BUCKETS, **({"metrics_port": port} if port else {})}
    return WorkerProcess(
        app=PROJ_APP,
        queue=queue,
        pool=pool,
        concurrency=concurrency,
        log_path=tmp_path / f"{name}.log",
        extra=extra,
        env=proj_env(queue=queue, broker=broker, GUARDRAILS_TEST_GUARDRAILS=json.dumps(settings), **env),
    )


def outcomes(samples: Samples, task: str) -> dict[tuple[str, str], float]:
    return {
        (labels["outcome"], labels["detail"]): count
        for (name, frozen), count in samples.items()
        if name == f"{metrics.TASK_OUTCOMES}" and (labels := dict(frozen))["task"] == task
    }


@BOTH_BROKERS
def test_outcomes_durations_and_queue_waits_of_each_kind_of_delivery(
    broker: str, celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a worker with metrics on and its endpoint, and messages of every kind of ending queued for it:
    # a 0.2 s sleep; a transient failure then a success; a permanent failure; a charge, then its duplicate;
    # and a message published as plain Celery would, without the publish time
    port = free_port()
    slow = tasks.behave_not_idempotent.delay(f"{sink.key}:slow", ["sleep:0.2"])
    flaky = tasks.behave.delay(f"{sink.key}:flaky", ["transient", "ok"])
    refused = tasks.behave.delay(f"{sink.key}:refused", ["permanent"])
    order_id = random.randrange(10**9)
    charged = tasks.charge.delay(order_id, f"{sink.key}:charge")
    plain = publish_raw(celery_app, queue_name, tasks.observe.name)
    with worker(tmp_path, queue_name, broker=broker, port=port) as started:
        # When they have all run (the duplicate is published once the first charge completed)
        slow.get(timeout=60)
        flaky.get(timeout=60)
        with pytest.raises(Exception, match="refused"):
            refused.get(timeout=60)
        charged.get(timeout=60)
        tasks.charge.delay(order_id, f"{sink.key}:charge").get(timeout=60)
        celery_app.AsyncResult(plain).get(timeout=60)
        behave, observe = tasks.behave.name, tasks.observe.name
        samples = wait_for(
            "every delivery counted",
            lambda: (
                (s := scrape(port))
                and value(s, metrics.MESSAGES_COMPLETED, task=behave, queue=queue_name) == 3
                and value(s, metrics.MESSAGES_COMPLETED, task=tasks.charge.name, queue=queue_name) == 2
                and value(s, metrics.MESSAGES_COMPLETED, task=observe, queue=queue_name) == 1
                and s
            ),
        )

    # Then the sleeping task's one duration is in the bucket above 0.2 s, the whole sequence (cumulative)
    duration = metrics.TASK_DURATION
    assert buckets(samples, duration, task=tasks.behave_not_idempotent.name, queue=queue_name) == [0, 0, 1, 1, 1]
    assert value(samples, f"{duration}_count", task=tasks.behave_not_idempotent.name, queue=queue_name) == 1
    # And each delivery's outcome is counted once, with its classification or reason
    assert outcomes(samples, tasks.behave_not_idempotent.name) == {("succeeded", ""): 1}
    assert outcomes(samples, behave) == {
        ("retried", "transient"): 1,
        ("succeeded", ""): 1,
        ("dead_lettered", "permanent"): 1,
    }
    assert outcomes(samples, tasks.charge.name) == {("succeeded", ""): 1, ("duplicate_skipped", "completed"): 1}
    assert outcomes(samples, observe) == {("succeeded", ""): 1}
    # And the queue wait is observed for every guarded delivery (the retry's too), and counted unknown, not
    # observed, for the message without a publish time
    wait = metrics.QUEUE_WAIT
    assert value(samples, f"{wait}_count", task=behave, queue=queue_name) == 3
    assert value(samples, f"{wait}_count", task=tasks.charge.name, queue=queue_name) == 2
    assert value(samples, f"{wait}_count", task=observe, queue=queue_name) == 0
    assert value(samples, metrics.QUEUE_WAIT_UNKNOWN, task=observe, queue=queue_name) == 1
    assert value(samples, metrics.QUEUE_WAIT_UNKNOWN, task=behave, queue=queue_name) == 0
    # And the retry the worker published counts as a message published (arrival), on the task's queue
    assert value(samples, metrics.MESSAGES_PUBLISHED, task=behave, queue=queue_name) == 1
    # And no recording failed
    assert "Metrics: recording" not in started.log


def test_prefork_children_are_summed_through_the_multiprocess_directory(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a prefork worker with three children, PROMETHEUS_MULTIPROC_DIR set to an empty directory
    folder = tmp_path / "prometheus"
    folder.mkdir()
    port = free_port()
    count = 9
    with worker(tmp_path, queue_name, pool="prefork", concurrency=3, port=port, PROMETHEUS_MULTIPROC_DIR=str(folder)):
        # When N tasks that take a while run (so that more than one child takes them)
        results = [tasks.behave_not_idempotent.delay(sink.key, ["sleep:0.3"]) for _ in range(count)]
        pids = {result.get(timeout=60)["pid"] for result in results}
        # Then the main process's endpoint counts N, summed over the children that ran them
        name = tasks.behave_not_idempotent.name
        samples = wait_for(
            "N completions",
            lambda: (
                (s := scrape(port)) and value(s, metrics.MESSAGES_COMPLETED, task=name, queue=queue_name) == count and s
            ),
        )
    assert len(pids) > 1
    assert outcomes(samples, name) == {("succeeded", ""): count}
    assert value(samples, f"{metrics.TASK_DURATION}_count", task=name, queue=queue_name) == count
    assert buckets(samples, metrics.TASK_DURATION, task=name, queue=queue_name) == [0, 0, count, count, count]
    # And each child recorded in a file of its own
    assert len({path.name for path in folder.glob("counter_*.db")}) >= len(pids)


def test_counts_outlive_the_children_and_the_main_process_records_a_time_limit(
    celery_app: Any, queue_name: str, tmp_path: Path
) -> None:
    # Given a prefork worker whose children exit after each task (marked dead as they go), and a task its hard
    # time limit kills (the main process dead-letters it: not retried, the task is not idempotent)
    folder = tmp_path / "prometheus"
    folder.mkdir()
    port = free_port()
    extra = ("--max-tasks-per-child=1",)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(folder)}
    with worker(tmp_path, queue_name, pool="prefork", concurrency=2, port=port, extra=extra, **env) as started:
        # When four tasks run, each in a child of its own, and the one that is killed
        pids = {tasks.observe.delay().get(timeout=60)["pid"] for _ in range(4)}
        killed = tasks.behave_not_idempotent.apply_async((f"{queue_name}:killed", ["sleep:60"]), time_limit=1)
        with pytest.raises(Exception, match="TimeLimitExceeded"):
            killed.get(timeout=60)
        # Then the endpoint still counts the four, though their children are gone
        samples = wait_for(
            "the four and the dead letter",
            lambda: (
                (s := scrape(port))
                and value(s, metrics.MESSAGES_COMPLETED, task=tasks.observe.name, queue=queue_name) == 4
                and outcomes(s, tasks.behave_not_idempotent.name)
                # (the completion is counted just after the outcome: wait for both, or a scrape between reads 0)
                and value(s, metrics.MESSAGES_COMPLETED, task=tasks.behave_not_idempotent.name, queue=queue_name)
                and s
            ),
        )
    assert len(pids) == 4
    assert outcomes(samples, tasks.observe.name) == {("succeeded", ""): 4}
    # And the killed one is counted dead-lettered and completed, once, by the main process
    assert outcomes(samples, tasks.behave_not_idempotent.name) == {("dead_lettered", "time_limit"): 1}
    assert value(samples, metrics.MESSAGES_COMPLETED, task=tasks.behave_not_idempotent.name, queue=queue_name) == 1
    assert "Metrics: recording" not in started.log


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_solo_and_threads_workers_serve_their_own_metrics(
    pool: str, celery_app: Any, queue_name: str, tmp_path: Path
) -> None:
    # Given a worker of that pool with metrics on and no multiprocess directory
    port = free_port()
    count = 4
    with worker(tmp_path, queue_name, pool=pool, concurrency=2, port=port):
        # When N tasks run
        for result in [tasks.observe.delay() for _ in range(count)]:
            result.get(timeout=60)
        # Then its endpoint counts N
        samples = wait_for(
            "N completions",
            lambda: (
                (s := scrape(port))
                and value(s, metrics.MESSAGES_COMPLETED, task=tasks.observe.name, queue=queue_name) == count
                and s
            ),
        )
    assert outcomes(samples, tasks.observe.name) == {("succeeded", ""): count}
    assert value(samples, f"{metrics.QUEUE_WAIT}_count", task=tasks.observe.name, queue=queue_name) == count


def ours(task_name: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """This process's samples about ``task_name``."""
    assert metrics.REGISTRY is not None
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in metrics.REGISTRY.collect()
        for sample in family.samples
        if sample.labels.get("task") == task_name
    }


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_with_metrics_off_nothing_is_recorded(on: bool, celery_app: Any, celery_worker: Any, queue_name: str) -> None:
    # Given the embedded worker, metrics off (the default) or on
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "metrics": on}
    before = ours(tasks.log_line.name)
    # When a task is published and runs
    tasks.log_line.delay("hello").get(timeout=60)
    # Then with metrics off nothing about it was recorded, neither publish nor delivery; on, both were
    after = wait_for("the after-hooks ran", lambda: (s := ours(tasks.log_line.name)) != before and s) if on else None
    if not on:
        assert ours(tasks.log_line.name) == before
        return
    assert after is not None
    completed = (metrics.MESSAGES_COMPLETED, frozenset({("task", tasks.log_line.name), ("queue", queue_name)}))
    published = (metrics.MESSAGES_PUBLISHED, frozenset({("task", tasks.log_line.name), ("queue", queue_name)}))
    wait_for("completed counted", lambda: ours(tasks.log_line.name).get(completed, 0) == before.get(completed, 0) + 1)
    assert after.get(published, 0) == before.get(published, 0) + 1


def test_a_recording_failure_does_not_fail_the_task(celery_app: Any, queue_name: str, tmp_path: Path) -> None:
    # Given a worker whose metrics cannot be written (its multiprocess directory does not exist)
    with worker(tmp_path, queue_name, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "not-there")) as started:
        # When tasks run
        results = [tasks.observe.delay() for _ in range(3)]
        # Then they succeed, and each kind of failure is logged once (then at DEBUG)
        assert all(result.get(timeout=60)["task"] == tasks.observe.name for result in results)
        wait_for("the end of the last delivery", lambda: started.log.count("succeeded in") == 3)
    assert started.log.count("Metrics: recording queue wait failed") == 1
    assert started.log.count("Metrics: recording the end of a delivery failed") == 1
    assert "FileNotFoundError" in started.log


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ({"metrics": "yes"}, "True or False"),
        ({"metrics_port": 70000}, "TCP port"),
        ({"metrics_port": "9100"}, "TCP port"),
        ({"metrics_buckets": [1.0, 0.5]}, "increasing"),
        ({"metrics_buckets": []}, "positive finite"),
        ({"metrics_buckets": [0.1, float("inf")]}, "positive finite"),
        ({"metrics_token": "short"}, "at least 16"),
    ],
)
def test_bad_metrics_settings_name_the_key(raw: dict[str, Any], text: str) -> None:
    # Given a bad metrics setting; When the settings are validated (as a worker starts); Then the key is named
    with pytest.raises(ConfigurationError, match=text) as caught:
        validate(raw)
    assert caught.value.key == next(iter(raw))


def test_label_values_lose_the_secrets_a_message_put_in_them(celery_app: Any) -> None:
    from celery_guardrails import signals
    from celery_guardrails.runtime.final_failure import FinalFailure
    from tests.proj import leaky
    from tests.support import planted
    from tests.support.planted import leaked

    # Given metrics on, and a dead letter whose queue (the publisher's routing key) and reason (carried in a
    # header by another producer) are free text with secrets in them
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "metrics": True}
    task = celery_app.tasks[leaky.leak_provider.name]
    failure = FinalFailure(
        task_name=task.name,
        task_id=f"labels-{random.random()}",
        reason=f"permanent {planted.STRIPE_KEY}",
        exc_type="tests.proj.leaky.ProviderError",
        exc_message="",
        tenant=None,
        correlation_id=None,
        attempts=1,
        queue=f"orders {planted.PG_URL}",
    )
    # When it is counted, and a message of the task is published with such a routing key
    signals.dead_lettered.send(sender=task, failure=failure)
    metrics._on_published(sender=task.name, routing_key=f"orders {planted.PG_URL}")
    # Then the labels say it, redacted: the dead letter's detail, and the published message's queue
    labels = [dict(labels) for (_, labels) in ours(task.name)]
    assert {"task": task.name, "outcome": "dead_lettered", "detail": "permanent [redacted]"} in labels
    assert any(label.get("queue", "").startswith("orders postgresql://app:[redacted]@") for label in labels), labels
    assert leaked(labels) == []


def test_the_endpoint_names_every_family_before_any_task_and_prefork_says_how_to_set_the_directory(
    celery_app: Any, queue_name: str, tmp_path: Path
) -> None:
    # Given a prefork worker with metrics on and its endpoint, started without PROMETHEUS_MULTIPROC_DIR
    port = free_port()
    with worker(tmp_path, queue_name, pool="prefork", concurrency=1, port=port, name="fresh") as started:
        # When the endpoint is scraped before any task ran
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        log = started.log
    # Then every family of the guardrails is there, with its HELP and TYPE lines and no sample yet
    for name, (kind, doc) in metrics.FAMILIES.items():
        assert f"# HELP {name} {doc}\n# TYPE {name} {kind}\n" in text, name
    assert [line for line in text.splitlines() if line.startswith(metrics.PREFIX)] == []
    # And the worker warned that the children's metrics are not seen, with the exact line that fixes it and
    # that the directory must be empty at each start
    (warning,) = [line for line in log.splitlines() if "prefork pool without PROMETHEUS_MULTIPROC_DIR" in line]
    assert (
        "rm -rf /tmp/celery-metrics && mkdir /tmp/celery-metrics && PROMETHEUS_MULTIPROC_DIR=/tmp/celery-metrics "
        "celery -A proj worker" in warning
    )
    assert "an empty directory at each start of the whole worker" in warning
