"""Fixtures shared by the whole suite: real brokers, an embedded worker per test, Redis sinks.

The embedded worker comes from Celery's own pytest plugin (``celery.contrib.pytest``: ``celery_app`` and
``celery_worker``), configured here for a real broker. Tests that need another broker are parametrized
indirectly over ``broker`` (``"redis"``, ``"amqp"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
from kombu import Connection
from kombu.asynchronous import set_event_loop

from tests.support.proxy import TcpProxy
from tests.support.redis_cluster import redis_cluster  # noqa: F401  (a session fixture, started on first use)
from tests.support.redis_sentinel import redis_sentinel  # noqa: F401  (a test's own master, replica, Sentinel)
from tests.support.services import BROKER_SERVICE, BROKER_URLS, REDIS_URL, release_claim, require
from tests.support.waiting import BOUND, wait_for
from tests.support.workers import STARTED

# pytester: the test kit's plugin is tested in pytest runs of its own (tests/celery_guardrails/testing).
pytest_plugins = ["pytester"]

BOTH_BROKERS = pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
#: Where a failed test's process logs are kept (CI prints them too).
FAILURES = Path(__file__).resolve().parents[1] / "test-artifacts" / "failures"
#: Lines of each process log printed with a failure (the whole log is kept under FAILURES).
LOG_TAIL = 150


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's controller only hands tests to its processes: the Redis database it claimed on import goes
    # back at once, for the passes make test runs beside this one (tests/support/services.py).
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        release_claim()


def pytest_unconfigure(config: pytest.Config) -> None:
    release_claim()


#: The modules of the suite's longest tests, run first: pytest-xdist hands tests out in collection order, and a
#: 160 s soak or a 120 s venv install drawn last held the PostgreSQL pass for minutes after the other processes
#: had finished (durations of a pass on a loaded 2-core host). Only these: many long tests at once on two cores
#: make each of them longer, and past pytest-timeout's bound.
SLOW_FIRST = (
    "tests/soak/test_run.py",  # 163 s and 103 s
    "tests/test_first_hour.py",  # 109 s, 100 s, 58 s, behind a venv installed once for the run
    "tests/test_packaging.py",  # a fresh venv from the package index, 106 s
    "tests/example_project/test_demo.py",  # 120 s
    "tests/django_app/test_alerts.py",  # 80 s
    "tests/celery_guardrails/runtime/test_headers.py",  # 67 s
    # (real prefork workers, each test 15 to 30 s: handed out early, so that none is the pass's last)
    "tests/django_app/test_waiting.py",
    "tests/django_app/test_activity.py",
    "tests/django_app/test_jobs.py",
    "tests/django_app/test_checkpoint.py",
    "tests/celery_guardrails/broker/test_quorum.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FIRST)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_first_process] = len(STARTED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's worker, beat and watchdog logs: the tail printed with the failure, the whole log kept
    in test-artifacts/failures/<test>/, so that a flake can be explained from the one run that saw it."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    processes = STARTED[item.stash.get(_first_process, len(STARTED)) :]
    if not processes:
        return
    folder = FAILURES / re.sub(r"[^\w.-]+", "_", item.nodeid)[-150:]
    folder.mkdir(parents=True, exist_ok=True)
    for index, process in enumerate(processes):
        log = process.log
        name = f"{index:02d}-{process.log_path.name}"
        (folder / name).write_text(log)
        tail = "\n".join(log.splitlines()[-LOG_TAIL:])
        report.sections.append((f"{process.log_path.name} (last {LOG_TAIL} lines; whole: {folder / name})", tail))


_first_process = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _no_stale_event_loop() -> None:
    """kombu < 5.6: ``Hub.close()`` leaves the closed hub as the process's event loop, and the next embedded
    worker adopts it with the previous worker's timer, so its countdowns and ETAs (every retry) never fire
    (celery/celery#9983, fixed by celery/kombu#2404 in kombu 5.6). Each test's worker makes a hub of its own."""
    set_event_loop(None)


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> str:
    name: str = getattr(request, "param", "redis")
    require("redis")  # results and sinks live in Redis whatever the broker
    require(BROKER_SERVICE[name])
    return name


@pytest.fixture
def queue_name() -> str:
    return f"gr-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def celery_config(broker: str, queue_name: str) -> Iterator[dict[str, Any]]:
    yield {
        "broker_url": BROKER_URLS[broker],
        "result_backend": REDIS_URL,
        "task_default_queue": queue_name,
        "result_expires": 600,
        "broker_connection_retry_on_startup": False,
        "worker_hijack_root_logger": False,
        # The Django app is installed in the test process, which would make "django" the default store; the
        # Django store is tested on its own (tests/django_app).
        # The activity off in the embedded worker: its counts, added from a thread of the test process, would
        # land in later tests' hours (a test that wants them turns it on: test_admin_browser.py).
        # Nor does it relay the outbox: a test relays it itself, and a thread of its own would race it.
        "guardrails": {"store": REDIS_URL, "dead_letter_sinks": ["redis"], "activity": False, "outbox_relay": False},
    }
    # Each test has its own queue; drop it so RabbitMQ does not collect empty queues run after run.
    with Connection(BROKER_URLS[broker]) as conn, contextlib.suppress(*conn.channel_errors):  # never declared
        conn.default_channel.queue_delete(queue_name)


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    # Celery's fixture leaves the previous app current; tasks published by name in a test (shared_task
    # proxies, Django views) must reach this one, as they would in a project.
    celery_app.set_current()
    celery_app.set_default()
    return celery_app


@pytest.fixture
def celery_worker_pool(request: pytest.FixtureRequest) -> str:
    """The embedded worker's pool: solo, or what a test asks for with indirect parametrization."""
    return getattr(request, "param", "solo")


@pytest.fixture
def celery_worker_parameters(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Extra WorkController arguments (e.g. {"concurrency": 2}), by indirect parametrization."""
    return getattr(request, "param", {})


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    return ["tests.proj.tasks"]


@pytest.fixture
def celery_worker(
    celery_app: Any, celery_includes: list[str], celery_worker_pool: str, celery_worker_parameters: dict[str, Any]
) -> Iterator[Any]:
    """Celery's embedded worker (``celery.contrib.pytest``'s fixture, the same ``start_worker``), stopped at once.

    ``start_worker`` stops it by setting ``should_terminate`` and joining its thread, but the event loop reads
    that flag only between two polls of its sockets, and an idle worker polls for up to a second: about 0.8 s
    of every test's teardown (hundreds of tests). A pipe made readable as the flag is set wakes the poll now.
    """
    from celery.contrib.testing.worker import start_worker
    from celery.worker import state

    for module in celery_includes:
        celery_app.loader.import_task_module(module)
    readable, writable = os.pipe()
    try:
        with start_worker(celery_app, pool=celery_worker_pool, **celery_worker_parameters) as worker:
            yield worker
            hub = getattr(worker, "hub", None)  # None where the pool runs no event loop (threads: a 2 s drain)
            if hub is not None:
                state.should_terminate = 0  # as start_worker's exit does, before the wake
                hub.add_reader(readable, lambda: None)
                os.write(writable, b"x")
    finally:
        os.close(readable)
        os.close(writable)


class Sink:
    """A Redis list that tasks push their reports to."""

    def __init__(self, key: str | None = None) -> None:
        self.key = key or f"gr-test-sink-{uuid.uuid4().hex}"
        self.client = redis.Redis.from_url(REDIS_URL)

    @classmethod
    def of(cls, key: str) -> Sink:
        """Another view on a list (a sink key with a suffix, used by one task of a test)."""
        return cls(key)

    def items(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(self.key, 0, -1)]

    def wait(self, count: int, timeout: float = BOUND) -> list[dict[str, Any]]:
        try:
            wait_for(f"{count} reports", lambda: self.client.llen(self.key) >= count, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}, got {self.items()}") from None
        return self.items()


@pytest.fixture
def sink() -> Iterator[Sink]:
    require("redis")
    box = Sink()
    yield box
    box.client.delete(box.key)


def waiting_messages(broker: str, queue: str) -> int:
    """Messages ready in ``queue`` on the real broker (unacked ones not counted)."""
    if broker == "redis":
        client = redis.Redis.from_url(BROKER_URLS["redis"])
        # kombu keeps one list per priority step: "<queue>" and "<queue>\x06\x16<step>".
        return sum(int(client.llen(key)) for key in [queue.encode(), *client.keys(f"{queue}\x06\x16*")])
    with Connection(BROKER_URLS[broker]) as conn:
        _, count, _ = conn.default_channel.queue_declare(queue, passive=True)
        return int(count)


def unacked(task_id: str) -> bool:
    """Whether a message of ``task_id`` is delivered and not yet acked on the Redis broker (kombu keeps it in
    its ``unacked`` hash until the ack): a test stops a worker only after its messages are acked, since a
    warm shutdown gives unacked ones back to the queue."""
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    return any(task_id.encode() in raw for raw in client.hvals("unacked"))


class _ProviderHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        self.server.requests.append(parts.path)  # type: ignore[attr-defined]
        if parts.path == "/reset":  # the request arrived; the connection dies before any answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if parts.path.startswith("/slow/"):  # answers after that many seconds (a client's read timeout)
            time.sleep(float(parts.path.rsplit("/", 1)[-1]))
            code = 200
        else:
            code = int(parts.path.rsplit("/", 1)[-1])
        self.send_response(code)
        for name, values in parse_qs(parts.query).items():
            self.send_header(name.replace("_", "-").title(), values[0])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


@pytest.fixture
def provider() -> Iterator[str]:
    """A real HTTP server on loopback: ``GET <url>/status/503?retry_after=7`` answers 503, Retry-After: 7;
    ``/slow/<seconds>`` answers 200 that late; ``/reset`` resets the connection once the request is in.
    The paths it was asked for are in ``provider_requests``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ProviderHandler)
    server.requests = _PROVIDER_REQUESTS  # type: ignore[attr-defined]
    _PROVIDER_REQUESTS.clear()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


_PROVIDER_REQUESTS: list[str] = []


@pytest.fixture
def provider_requests(provider: str) -> list[str]:
    """The paths the ``provider`` was asked for, in order."""
    return _PROVIDER_REQUESTS


@pytest.fixture
def received() -> Iterator[Callable[..., list[dict[str, Any]]]]:
    """``received(signal)`` starts collecting what ``signal`` sends; call the result again to read it."""
    connected: list[tuple[Any, Callable[..., None]]] = []

    def listen(signal: Any) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = []

        def receiver(sender: Any = None, **kwargs: Any) -> None:
            calls.append({"sender": sender, **kwargs})

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return calls

    yield listen
    for signal, receiver in connected:
        signal.disconnect(receiver)


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server on loopback that keeps the JSON of every POST (alert webhooks)."""
    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/dead-letters", received
    server.shutdown()


@pytest.fixture
def rigs() -> Iterator[list[Any]]:
    """Scheduled-work rigs (tests/support/scheduling.py) a test makes; their processes stop afterwards."""
    require("redis")
    made: list[Any] = []
    yield made
    for rig in made:
        rig.stop()


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    """A TCP proxy in front of the test Redis, to cut and restore (a test module may define its own)."""
    require("redis")
    forwarder = TcpProxy(6379)
    yield forwarder
    forwarder.close()


@pytest.fixture
def broker_client(queue_name: str) -> Iterator[redis.Redis]:
    """The Redis broker; afterwards, what the test's messages left in kombu's keys (unacked records, the queue,
    items the atomic pop moved aside as malformed) is removed."""
    from celery_guardrails.broker.atomic_pop import MALFORMED_KEY

    require("redis")
    client = redis.Redis.from_url(BROKER_URLS["redis"])
    yield client
    for tag, raw in client.hgetall("unacked").items():
        if queue_name.encode() in raw:
            client.zrem("unacked_index", tag)
            client.hdel("unacked", tag)
    client.delete(queue_name)
    for item in client.lrange(MALFORMED_KEY, 0, -1):
        if queue_name.encode() in item:
            client.lrem(MALFORMED_KEY, 0, item)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """pytest-django's test databases, and before each is dropped, every other session still on it ended and named
    in a warning: PostgreSQL refuses to drop a database in use, and pytest-django then warns and leaves it on the
    server (one a run, from a session a worker or a proxied connection of a test still held at the end)."""
    yield
    from django.db import connections

    with django_db_blocker.unblock():
        for alias in connections:
            connection = connections[alias]
            if connection.vendor != "postgresql":
                continue
            try:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pid, application_name, client_port, state, backend_start, left(query, 80), "
                        "pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                    ended = cursor.fetchall()
            except Exception as exc:  # a warning, as pytest-django's own failure to drop it is
                warnings.warn(f"could not end the other sessions on {alias}'s test database: {exc!r}", stacklevel=1)
                continue
            if ended:
                name = connection.settings_dict["NAME"]
                warnings.warn(f"ended {len(ended)} session(s) still on {name}, to drop it: {ended}", stacklevel=1)
