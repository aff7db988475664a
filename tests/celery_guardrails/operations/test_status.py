"""``celery -A proj guardrails status`` (celery_guardrails.operations.cli, celery_guardrails.operations.status), run as
a real command."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from celery_guardrails.foundation.clock import set_file_clock
from celery_guardrails.operations import status
from celery_guardrails.stores.base import OutcomeCount, QueueSample
from celery_guardrails.stores.redis import RedisStore
from tests.conftest import BOTH_BROKERS
from tests.proj import tasks
from tests.support import zygote
from tests.support.services import REDIS_URL
from tests.support.stores import forget
from tests.support.waiting import BOUND, wait_for
from tests.support.workers import PROJ_APP, ROOT, proj_env


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", PROJ_APP, "guardrails", "status", *args]


def environment(queue: str, broker: str = "redis") -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **proj_env(queue=queue, broker=broker)}


def run(*args: str, queue: str, broker: str = "redis") -> subprocess.CompletedProcess[str]:
    return zygote.run(command(*args), cwd=ROOT, env=environment(queue, broker), timeout=BOUND)


@BOTH_BROKERS
def test_status_json_prints_the_depth_of_the_apps_queue(broker: str, celery_app: Any, queue_name: str) -> None:
    # Given three messages waiting in the queue the app of the command declares
    for index in range(3):
        tasks.log_line.delay(f"line {index}")

    # When `celery -A tests.proj.app guardrails status --json` runs
    done = run("--json", queue=queue_name, broker=broker)

    # Then it exits 0 and its JSON gives the queue's depth (and, on RabbitMQ, an unknown age)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    queue = next(q for q in printed["queues"] if q["queue"] == queue_name)
    assert queue["depth"] == 3
    assert queue["unknown_age"] is (broker == "amqp")
    assert printed["errors"] == {}


def test_status_table_and_a_bounded_watch(broker: str, celery_app: Any, queue_name: str) -> None:
    # Given a message waiting in the queue
    tasks.log_line.delay("waiting")

    # When the status is watched for two reads
    done = run("--watch", "--count", "2", "--interval", "0.2", queue=queue_name)

    # Then it exits 0 after printing the tables twice, the second with each queue's depth change per second
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Queues") == 2
    assert done.stdout.count("CHANGE/S") == 1
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith(queue_name))
    assert line.split()[1] == "1"
    assert "Traceback" not in done.stderr


def test_ctrl_c_ends_a_watch_with_exit_0(broker: str, celery_app: Any, queue_name: str, tmp_path: Path) -> None:
    # Given a watch without an end, writing to a file
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        process = subprocess.Popen(
            command("--watch", "--interval", "0.2"),
            cwd=ROOT,
            env=environment(queue_name),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for("two reads printed", lambda: out.read_text().count("Queues") >= 2)

        # When it gets SIGINT, as a terminal's Ctrl-C sends it
        os.killpg(process.pid, signal.SIGINT)

        # Then it ends with exit 0 and no traceback
        assert process.wait(BOUND) == 0
        assert "Traceback" not in out.read_text()
    finally:
        if process.poll() is None:
            process.kill()


def test_a_source_that_cannot_be_read_is_named_and_the_others_are_read(
    broker: str, celery_app: Any, queue_name: str
) -> None:
    # Given an app whose store cannot be reached (nothing listens on its port) and a message in its queue
    tasks.log_line.delay("waiting")
    celery_app.conf.guardrails = {
        "store": "redis://127.0.0.1:1/0",
        "dead_letter_sinks": ["redis"],
        "store_timeout": 1.0,
        "schedules": {},
    }

    # When the status is gathered
    read = status.gather(celery_app)

    # Then the dead letters are named as failed, the queue is still read, and the table says so
    assert status.DEAD_LETTERS in read.errors
    assert next(q for q in read.queues if q.queue == queue_name).depth == 1
    assert "could not be read" in status.render(read)
    assert json.loads(status.as_json(read))["errors"].keys() == read.errors.keys()


def test_a_broker_that_cannot_be_reached_is_named_and_the_command_exits_1(celery_app: Any, queue_name: str) -> None:
    # Given the command's app pointed at a broker port nothing listens on
    env = {**environment(queue_name), "GUARDRAILS_TEST_BROKER_URL": "redis://127.0.0.1:1/0"}

    # When the status is read once
    done = zygote.run(command("--json"), cwd=ROOT, env=env, timeout=BOUND)

    # Then it prints what it read, names the queues as not read, exits 1, and prints no traceback
    assert done.returncode == 1
    assert "queues" in json.loads(done.stdout)["errors"]
    assert "Traceback" not in done.stderr


def test_rates_in_and_out_from_the_activity_the_workers_keep(celery_app: Any, queue_name: str, tmp_path: Path) -> None:
    # Given a queue whose deliveries ended at 10 a minute over the last five whole minutes while its depth grew
    # from 40 to 60 (as the workers' counts and the watchdog's samples would have it), on the command's clock
    base = float(978_307_200 + random.randrange(0, 90_000) * 3600 + 600)
    store = RedisStore(REDIS_URL)
    task = f"tests.status.{uuid.uuid4().hex[:8]}"
    start = base - 300
    store.activity_add(
        [
            OutcomeCount(minute=start + m * 60, task=task, queue=queue_name, outcome="succeeded", count=10)
            for m in range(5)
        ],
        batch=uuid.uuid4().hex,
        retention=3600,
    )
    store.activity_sample([QueueSample(minute=start, queue=queue_name, depth=40, oldest_age=3.0)], retention=3600)
    store.activity_sample([QueueSample(minute=base, queue=queue_name, depth=60, oldest_age=9.0)], retention=3600)
    clock = tmp_path / "clock"
    set_file_clock(clock, base + 30)
    env = {
        **environment(queue_name),
        "GUARDRAILS_CLOCK_FILE": str(clock),
        "GUARDRAILS_TEST_GUARDRAILS": json.dumps({"clock": "celery_guardrails.foundation.clock.file_clock"}),
    }
    try:
        # When the status is printed, as JSON and as the table
        done = zygote.run(command("--json"), cwd=ROOT, env=env, timeout=BOUND)
        done.check_returncode()
        printed = json.loads(done.stdout)
        table = zygote.run(command(), cwd=ROOT, env=env, timeout=BOUND)
        table.check_returncode()
    finally:
        forget("redis", f"guardrails:{{activity}}:{int(base // 3600 * 3600)}")
    # Then out is 10 a minute and in 14 (out plus the depth's change of 20 over 5 minutes)
    rate = printed["rates"][queue_name]
    assert (rate["completed"], rate["arrived"], rate["minutes"]) == (10.0, 14.0, 5)
    assert "IN/MIN" in table.stdout and "OUT/MIN" in table.stdout
    line = next(line for line in table.stdout.splitlines() if line.strip().startswith(queue_name))
    assert line.split()[3:5] == ["14.0", "10.0"]


def test_a_source_that_cannot_be_read_is_reported_without_its_secrets() -> None:
    from celery_guardrails.exceptions import StoreUnavailableError
    from celery_guardrails.operations.status import attempt
    from tests.support import planted

    # Given a store whose error names its URL, password included
    def read() -> None:
        raise StoreUnavailableError(f"Redis store at {planted.REDIS_URL} unavailable: refused")

    errors: dict[str, str] = {}
    # When the status reads it, then what the commands print says which store, not its password
    assert attempt("store", read, errors) is None
    assert errors == {
        "store": "StoreUnavailableError: Redis store at redis://:[redacted]@cache:6379/0 unavailable: refused"
    }


def test_a_dependencys_budget_reads_as_whole_retries_per_window(celery_app: Any) -> None:
    # Given a status whose dependency has used 1.825 weighted retries of 3 allowed per 60 s (the store's sliding
    # window weighs the previous window's count), and another exhausted
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "schedules": {}}
    read = dataclasses.replace(
        status.gather(celery_app),
        dependencies=[
            status.DependencyStatus(
                dependency="payments-api",
                retries=1.825,
                retries_allowed=3.0,
                exhausted=False,
                circuit="closed",
                consecutive_failures=0,
                window_seconds=60.0,
            ),
            status.DependencyStatus(
                dependency="mail-api",
                retries=2.2,
                retries_allowed=3.4,
                exhausted=True,
                circuit="open",
                consecutive_failures=5,
                window_seconds=600.0,
            ),
        ],
    )
    # When the table is rendered
    table = status.render(read)
    # Then each budget reads as whole retries of whole retries allowed, with the window's unit: no fractions
    assert "RETRY BUDGET" in table
    rows = [line.split() for line in table.splitlines() if line.strip().startswith(("payments-api", "mail-api"))]
    assert [" ".join(row) for row in rows] == [
        "payments-api 2 of 3 retries per 60 s closed",
        "mail-api 3 of 3 retries per 10 min exhausted open",
    ]
