"""The retry gate: every automatic re-run asks one question, and a non-idempotent effect happens once.

The decision table first (celery_guardrails.runtime.gate.judge over delivery states), then the rubric's cases on a real
prefork worker, each effect counted where it lands: at a fake payments provider (a real HTTP server on
loopback, the one boundary mocked), never by counting runs alone.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery

from celery_guardrails import GuardedTask, tenant_context
from celery_guardrails.options import TaskOptions
from celery_guardrails.runtime import gate
from celery_guardrails.runtime.delivery import Delivery
from celery_guardrails.runtime.effects import provider_key
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of
from tests.support.services import require
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env

TIMEOUT = 30

app = Celery("gate-table", set_as_current=False)


@app.task(base=GuardedTask, bind=True)
def unmarked(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True)
def marked(self: GuardedTask) -> None:
    with self.effect():
        pass


@app.task(base=GuardedTask, bind=True, idempotency_key="k:{n}")
def keyed(self: GuardedTask, n: int) -> None: ...


@app.task(base=GuardedTask, bind=True, idempotency_key="k:{n}", atomic=True)
def atomic(self: GuardedTask, n: int) -> None: ...


@app.task(base=GuardedTask, bind=True, idempotent=True)
def idempotent(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, retry_unsafe=True)
def unsafe(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, marks_effects=True)
def marks_elsewhere(self: GuardedTask) -> None: ...


KEY = "tests:-:k:1"


@pytest.mark.parametrize(
    ("task", "state", "safe"),
    [
        # a body that marks nothing: one effect from its first line
        (unmarked, Delivery(), False),
        # marked: safe until an effect completed
        (marked, Delivery(), True),
        (marked, Delivery(effects=1), False),
        (marks_elsewhere, Delivery(), True),
        # keyed: the key guards a retry only once it went downstream, before any effect
        (keyed, Delivery(key=KEY), False),
        (keyed, Delivery(key=KEY, key_read_at=0), True),
        (keyed, Delivery(key=KEY, key_read_at=1, effects=1), False),
        (marked, Delivery(key=KEY, key_read_at=0, effects=2), True),
        # atomic: its database work rolls back with the key; an effect it marked does not
        (atomic, Delivery(key=KEY), True),
        (atomic, Delivery(key=KEY, effects=1), False),
        # declared: whatever the body did
        (idempotent, Delivery(effects=3), True),
        (unsafe, Delivery(effects=3), True),
    ],
)
def test_the_decision_table(task: Any, state: Delivery, safe: bool) -> None:
    # Given a delivery in this state, When the gate is asked, Then it answers as the table says, with a reason
    answer = gate.judge(TaskOptions(task=task), state)
    assert answer.safe is safe
    assert answer.why
    if not safe:
        assert answer.note.startswith("not retried: ") and answer.fix and answer.fix in answer.note
        assert "self.request.idempotency_key" in answer.fix


def test_a_body_killed_by_its_time_limit_is_judged_by_its_options_alone() -> None:
    # The worker's main process cannot see what the killed process did
    assert gate.after_kill(TaskOptions(task=unmarked), keyed=False).safe is False
    assert gate.after_kill(TaskOptions(task=marked), keyed=False).safe is False
    assert gate.after_kill(TaskOptions(task=keyed), keyed=True).safe is False
    assert gate.after_kill(TaskOptions(task=atomic), keyed=True).safe is True
    assert gate.after_kill(TaskOptions(task=idempotent), keyed=False).safe is True


# The rubric's cases on a real prefork worker.


class Provider:
    """A fake payments provider: ``POST /charges/<id>`` charges (200); ``POST /flaky/<id>`` answers 503 to the
    first ``failing[path]`` requests of that path (all of them when not set), then 200. Every request is kept
    with its Idempotency-Key header."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.failing: dict[str, int] = {}
        self.lock = threading.Lock()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                path = urlsplit(self.path).path
                with provider.lock:
                    provider.requests.append((path, self.headers.get("Idempotency-Key")))
                    earlier = sum(1 for seen, _ in provider.requests if seen == path)
                    failing = provider.failing.get(path, 10**9)
                status = 503 if path.startswith("/flaky/") and earlier <= failing else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def calls(self, path: str) -> list[str | None]:
        """The Idempotency-Key of each request to ``path``, in order."""
        with self.lock:
            return [key for seen, key in self.requests if seen == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def payments() -> Iterator[Provider]:
    provider = Provider()
    yield provider
    provider.close()


@pytest.fixture
def oid() -> int:
    """An order id of this test run's own: a completed or failed key is kept for days."""
    return uuid.uuid4().int % 10**9


def worker_queue(tmp_path_factory: pytest.TempPathFactory, *, pool: str, concurrency: int) -> Iterator[str]:
    """A real worker of the tests' app on ``pool``, consuming a queue of its own (yielded)."""
    require("redis")
    queue = f"gr-gate-{pool}-{uuid.uuid4().hex[:12]}"
    log = Path(tmp_path_factory.mktemp(f"gate-{pool}")) / "worker.log"
    with WorkerProcess(
        app=PROJ_APP, queue=queue, log_path=log, pool=pool, concurrency=concurrency, env=proj_env(queue=queue)
    ):
        yield queue


@pytest.fixture(scope="module")
def prefork_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real prefork worker (two child processes) for the module."""
    yield from worker_queue(tmp_path_factory, pool="prefork", concurrency=2)


def run(task: Any, *args: Any, queue: str) -> Any:
    return task.apply_async(args, queue=queue)


def test_an_effect_then_a_refused_connection_charges_once(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink
) -> None:
    # Given a task with no key, not idempotent, that charges, then calls a notifier that refuses the connection
    result = run(tasks.charge_then_notify, payments.url, 1, sink.key, queue=prefork_queue)
    # When it runs on a prefork worker
    with pytest.raises(Exception, match=r"Connection refused|Max retries"):
        result.get(timeout=TIMEOUT)
    # Then the charge was sent once (the refused call proves nothing about the charge before it)
    assert payments.calls("/charges/1") == [None]
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["attempts"]) == ("not_idempotent", 1)
    assert "marks no effect" in record["history"][-1]["note"]


def test_autoretry_for_on_a_task_that_is_not_idempotent_charges_once(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink
) -> None:
    # Given Celery's autoretry_for=(Exception,) on a task that charges, then fails
    result = run(tasks.autoretried_charge, payments.url, 2, sink.key, queue=prefork_queue)
    with pytest.raises(RuntimeError, match="receipt"):
        result.get(timeout=TIMEOUT)
    # Then Celery's retry went through the gate: one charge, one run, a dead letter that says why
    assert payments.calls("/charges/2") == [None]
    assert Sink.of(f"{sink.key}:runs").client.get(f"{sink.key}:runs") == b"1"
    record = dead_letter_of(celery_app, result.id)
    assert record["reason"] == "not_idempotent"
    assert record["history"][-1]["rule"] == "autoretry_for:not_idempotent"


def test_self_retry_counts_in_max_attempts(celery_app: Any, prefork_queue: str, sink: Sink) -> None:
    # Given an idempotent task with max_attempts=3 that calls self.retry() every time
    result = run(tasks.asks_again, sink.key, queue=prefork_queue)
    with pytest.raises(Exception):  # noqa: B017  (Celery's MaxRetriesExceededError, rebuilt by the backend)
        result.get(timeout=TIMEOUT)
    # Then it ran 3 times, and its dead letter holds the 3 attempts
    assert sink.client.get(f"{sink.key}:runs") == b"3"
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["attempts"]) == ("attempts_exhausted", 3)
    assert [(r["n"], r["class"], r["rule"]) for r in record["history"]] == [
        (1, "manual", "self.retry"),
        (2, "manual", "self.retry"),
        (3, "manual", "self.retry"),
    ]
    assert [r["delay"] for r in record["history"]] == [0.05, 0.05, None]


def test_self_retry_after_an_effect_is_refused(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink
) -> None:
    # Given a task that is not idempotent, charges, then asks for a retry itself
    result = run(tasks.asks_again_not_idempotent, payments.url, sink.key, queue=prefork_queue)
    with pytest.raises(Exception):  # noqa: B017
        result.get(timeout=TIMEOUT)
    # Then the gate refused it: one charge
    assert payments.calls("/charges/asks-again") == [None]
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["history"][-1]["rule"]) == ("not_idempotent", "self.retry:not_idempotent")


def test_a_key_kept_to_itself_does_not_guard_a_retry(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink, oid: int
) -> None:
    # Given a keyed task (not atomic) whose body never hands its key to the provider, which answers 503
    result = run(tasks.keyed_key_kept, payments.url, oid, sink.key, queue=prefork_queue)
    with pytest.raises(Exception, match="503"):
        result.get(timeout=TIMEOUT)
    # Then one call: the provider may have acted on it, and a second call would carry nothing to dedupe by
    assert payments.calls(f"/flaky/{oid}") == [None]
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["history"][-1]["rule"]) == ("not_idempotent", "http:503:not_idempotent")
    assert "never handed its idempotency key" in record["history"][-1]["note"]


def test_a_key_handed_to_the_provider_guards_the_retries(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink, oid: int
) -> None:
    # Given a keyed task that passes self.request.idempotency_key to a provider answering 503 twice, then 200
    payments.failing[f"/flaky/{oid}"] = 2
    with tenant_context("acme"):
        result = run(tasks.keyed_key_handed, payments.url, oid, sink.key, queue=prefork_queue)
    # Then it succeeds on the third call, every call carrying the same key
    assert result.get(timeout=TIMEOUT) == "paid"
    calls = payments.calls(f"/flaky/{oid}")
    assert len(calls) == 3 and len(set(calls)) == 1
    # And the key tells the provider nothing: no module path, no tenant (a UUID made from the scoped key)
    (key,) = set(calls)
    assert key == provider_key(f"tests.proj.tasks.keyed_key_handed:acme:pay:{oid}")
    assert "acme" not in str(key) and "tests" not in str(key)
    uuid.UUID(str(key))


def test_a_value_error_in_a_keyed_task_runs_once(celery_app: Any, prefork_queue: str, sink: Sink, oid: int) -> None:
    # Given a keyed task whose input is wrong
    result = run(tasks.keyed_value_error, oid, sink.key, queue=prefork_queue)
    with pytest.raises(ValueError, match="positive"):
        result.get(timeout=TIMEOUT)
    # Then one run: a validation failure is not retried
    assert sink.client.get(f"{sink.key}:runs") == b"1"
    record = dead_letter_of(celery_app, result.id)
    assert (record["reason"], record["history"][-1]["rule"]) == ("permanent", "deterministic_errors")


def test_a_refused_connection_inside_the_effect_is_retried_and_the_effect_lands_once(
    celery_app: Any, prefork_queue: str, payments: Provider, sink: Sink
) -> None:
    # Given a body that marks its charge, whose provider refuses the connection on the first run
    result = run(tasks.marked_charge, payments.url, 7, sink.key, queue=prefork_queue)
    # Then the refusal proves nothing was sent: retried, and the charge landed once
    assert result.get(timeout=TIMEOUT) == "charged"
    assert sink.client.get(f"{sink.key}:runs") == b"2"
    assert payments.calls("/charges/7") == [None]


@pytest.fixture(scope="module")
def threads_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real worker on the threads pool (four threads)."""
    yield from worker_queue(tmp_path_factory, pool="threads", concurrency=4)


def test_on_threads_each_delivery_counts_its_own_effects(
    celery_app: Any, threads_queue: str, payments: Provider, sink: Sink
) -> None:
    # Given deliveries running side by side in one process's threads: bodies whose effect is refused at first,
    # and bodies that charge and then fail
    marked = [
        run(tasks.marked_charge, payments.url, 100 + n, f"{sink.key}:m{n}", queue=threads_queue) for n in range(4)
    ]
    failing = [
        run(tasks.charge_then_notify, payments.url, 200 + n, f"{sink.key}:f{n}", queue=threads_queue) for n in range(4)
    ]
    # Then each body's effects are its own: every refused booking retried and charged once, every charge that
    # came before a failure left alone (one charge each)
    assert [result.get(timeout=TIMEOUT) for result in marked] == ["charged"] * 4
    for result in failing:
        with pytest.raises(Exception, match=r"Connection refused|Max retries"):
            result.get(timeout=TIMEOUT)
    assert [len(payments.calls(f"/charges/{100 + n}")) for n in range(4)] == [1, 1, 1, 1]
    assert [len(payments.calls(f"/charges/{200 + n}")) for n in range(4)] == [1, 1, 1, 1]
    assert {dead_letter_of(celery_app, result.id)["reason"] for result in failing} == {"not_idempotent"}
