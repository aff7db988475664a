"""The claim with the pop (celery_guardrails.guardrails.pop_claims): where the store is the broker's Redis, the
script that takes a keyed message claims its key. On real workers whose broker and store are the same Redis, with
the server's own MONITOR saying which commands named the key, and from where (a client, or a script).
"""

from __future__ import annotations

import hashlib
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_guardrails.broker import atomic_pop
from celery_guardrails.guardrails import pop_claims
from celery_guardrails.stores.redis import RedisStore
from celery_guardrails.stores.redis_idempotency import _CLAIM, _COMPLETE_ACK, _IF_OWNER, IDEM_PREFIX
from tests.conftest import Sink, unacked, waiting_messages
from tests.proj import tasks
from tests.support.services import REDIS_URL
from tests.support.shared_redis import QUIET, effects, key_of, shared_worker
from tests.support.waiting import wait_for

TIMEOUT = 60


def state_of(key: str) -> str | None:
    return (RedisStore(REDIS_URL).inspect(key) or {}).get("state")


@dataclass(frozen=True)
class Command:
    """One command the server ran on the test's database: from a client (``tcp``) or inside a script (``lua``)."""

    source: str
    text: str


@contextmanager
def monitored() -> Iterator[list[Command]]:
    """Every command the Redis server runs on the test's database while the block runs (its MONITOR)."""
    database = int(REDIS_URL.rsplit("/", 1)[1])
    seen: list[Command] = []
    done = threading.Event()
    client = redis.Redis.from_url(REDIS_URL)
    ready = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                if command["db"] == database:
                    seen.append(Command(source=command["client_type"], text=command["command"]))
                if done.is_set() and "gr-test-monitor-end" in command["command"]:
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(5)
    time.sleep(0.2)  # MONITOR is on once the server answered it
    try:
        yield seen
    finally:
        done.set()
        client.get("gr-test-monitor-end")
        watcher.join(10)


def naming(commands: list[Command], key: str, *, source: str) -> list[str]:
    """The commands from ``source`` that name ``key`` (the store's Redis key of a scoped key), but the test's own
    reads of it (HGETALL)."""
    return [
        command.text
        for command in commands
        if command.source == source and IDEM_PREFIX + key in command.text and not command.text.startswith("HGETALL")
    ]


#: The store's scripts a worker may run on a key, by their SHA (EVALSHA) and by a line of their text (an EVAL, as
#: redis-py sends one after a NOSCRIPT: another test may flush the server's scripts).
SCRIPTS = {
    "claim": (_CLAIM, "local function claim"),
    "completion with the ack": (_COMPLETE_ACK, "local function finish"),
    "completion": (_IF_OWNER, "local action = ARGV[2]"),
}


def scripts_naming(commands: list[Command], key: str) -> list[str]:
    """The store scripts clients ran on ``key``, in order. A script sent again right after a NOSCRIPT (another test
    flushed the server's scripts: the lane's EVALSHA, redis-py's, then its load and EVALSHA or a whole EVAL) counts
    once: the attempts that met NOSCRIPT ran nothing."""
    found: list[str] = []
    for text in naming(commands, key, source="tcp"):
        if text.startswith("EVALSHA"):
            sha = text.split()[1]
            names = [name for name, (script, _) in SCRIPTS.items() if hashlib.sha1(script.encode()).hexdigest() == sha]
        elif text.startswith("EVAL"):
            names = [next(name for name, (_, line) in SCRIPTS.items() if line in text)]
        else:
            continue
        found += [name for name in names if not found or found[-1] != name]
    return found


def script_of(commands: list[Command], key: str) -> str:
    """The client command whose script first named ``key``, up to the malformed list (the pop's last key before the
    queues it pops from)."""
    named = (i for i, command in enumerate(commands) if command.source == "lua" and IDEM_PREFIX + key in command.text)
    first = next(named)
    sent = next(command.text for command in reversed(commands[:first]) if command.source != "lua")
    head, found, _ = sent.partition(atomic_pop.MALFORMED_KEY)
    return head + found


@pytest.fixture
def oid() -> int:
    return random.randrange(10**9)


@pytest.fixture(autouse=True)
def _no_leftover_gates(sink: Sink) -> Iterator[None]:
    yield
    sink.client.delete(f"{sink.key}:gate")


def test_a_keyed_message_is_claimed_by_its_pop_and_its_only_own_command_is_the_completion_with_the_ack(
    celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path
) -> None:
    # Given a solo worker whose store is the broker's Redis, with a lease of 18 s: a claim is taken without asking
    # for 5 s after its pop (at 6 s, for 1 s only, which a busy machine's first task may overstay)
    oids = [random.randrange(10**9) for _ in range(5)]
    with shared_worker(queue_name, tmp_path, idempotency_lease=18.0) as running, monitored() as commands:
        # When keyed tasks whose results are ignored run there
        results = [tasks.charge_quietly.delay(oid, sink.key) for oid in oids]
        wait_for("every body ran", lambda: effects(sink) == 5, timeout=TIMEOUT)
        wait_for("every message acked", lambda: not any(unacked(r.id) for r in results), timeout=TIMEOUT)
        wait_for("every key completed", lambda: all(state_of(key_of(o)) == "completed" for o in oids), timeout=TIMEOUT)
    assert "idempotency keys claimed by the pop" in running.log
    for oid in oids:
        # Then each key was claimed inside the pop's script, where the message was taken from its list
        assert any("HSET" in text and "claimed" in text for text in naming(commands, key_of(oid), source="lua"))
        assert script_of(commands, key_of(oid)).endswith(atomic_pop.MALFORMED_KEY)
        # and the one script the worker ran on it of its own is its completion with the ack
        assert scripts_naming(commands, key_of(oid)) == ["completion with the ack"]
    assert effects(sink) == 5


def test_a_task_with_a_lease_of_its_own_asks_again_under_the_pops_owner(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a solo worker whose store is the broker's Redis, and a keyed task whose lease is its own (20 s, the
    # app's is 6 s: the pop claims with the app's)
    key = f"{QUIET}_leased:-:charge:{oid}"
    with shared_worker(queue_name, tmp_path) as running, monitored() as commands:
        # When it runs there
        result = tasks.charge_quietly_leased.delay(oid, sink.key)
        wait_for("the key completed", lambda: state_of(key) == "completed", timeout=TIMEOUT)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
    # Then the task claimed it again with its own lease, under the owner the pop minted (nothing released first),
    # and completed it with the ack
    assert scripts_naming(commands, key) == ["claim", "completion with the ack"]
    assert "let go" not in running.log
    assert effects(sink) == 1


@pytest.mark.parametrize(
    ("pool", "settings"),
    [("prefork", {}), ("solo", {"claim_on_pop": False})],
    ids=["prefork", "claim_on_pop off"],
)
def test_elsewhere_the_task_claims_its_key_as_it_starts(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path, pool: str, settings: dict[str, Any]
) -> None:
    # Given a prefork worker (its children cannot see what the pop would keep), or a solo one with claim_on_pop off
    with shared_worker(queue_name, tmp_path, pool=pool, **settings) as running, monitored() as commands:
        # When a keyed task runs there
        result = tasks.charge_quietly.delay(oid, sink.key)
        wait_for("the key completed", lambda: state_of(key_of(oid)) == "completed", timeout=TIMEOUT)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
    # Then the worker claimed it with a script of its own (and completed it with another)
    assert scripts_naming(commands, key_of(oid))[0] == "claim"
    assert "claimed by the pop" not in running.log
    assert effects(sink) == 1


def test_a_message_with_a_countdown_is_claimed_as_it_starts_not_as_it_is_popped(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a solo worker whose store is the broker's Redis
    with shared_worker(queue_name, tmp_path), monitored() as commands:
        # When a keyed message with a countdown arrives (the worker holds it in memory until it is due)
        result = tasks.charge_quietly.apply_async((oid, sink.key), countdown=1)
        wait_for("the key completed", lambda: state_of(key_of(oid)) == "completed", timeout=TIMEOUT)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
    # Then its pop claimed nothing (a claim would have waited with it): the task claimed as it started
    assert scripts_naming(commands, key_of(oid))[0] == "claim"
    assert effects(sink) == 1


def test_duplicates_popped_together_run_once(celery_app: Any, queue_name: str, sink: Sink, tmp_path: Path) -> None:
    # Given a threads worker (4) whose store is the broker's Redis
    oids = [random.randrange(10**9) for _ in range(5)]
    with shared_worker(queue_name, tmp_path, pool="threads", concurrency=4, retry_later_delay=0.1) as running:
        # When every keyed message is published twice at once (the second pop finds the key claimed by the first)
        results = [tasks.charge_quietly.delay(oid, sink.key) for oid in oids for _ in range(2)]
        wait_for("every message acked", lambda: not any(unacked(r.id) for r in results), timeout=TIMEOUT)
        wait_for("every key completed", lambda: all(state_of(key_of(o)) == "completed" for o in oids), timeout=TIMEOUT)
        wait_for("every duplicate skipped", lambda: running.log.count("not running it again") == 5, timeout=TIMEOUT)
    # Then each key's body ran once
    assert effects(sink) == 5
    assert "Traceback" not in running.log


def test_a_claim_that_waited_past_its_lease_is_asked_again_and_a_takeover_meanwhile_wins(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a threads worker with one thread, busy with a task held at a gate, and a keyed message it popped
    # (and claimed) meanwhile, waiting for the thread
    gate = f"{sink.key}:gate"
    other_queue = f"{queue_name}-other"
    first = shared_worker(queue_name, tmp_path, pool="threads", idempotency_lease=3.0, name="first")
    second = shared_worker(other_queue, tmp_path, idempotency_lease=3.0, name="second")
    with first as held, second as other:
        tasks.charge_quietly.delay(random.randrange(10**9), sink.key, gate)
        wait_for("the thread held", lambda: effects(sink) == 1, timeout=TIMEOUT)
        waiting = tasks.charge_quietly.delay(oid, sink.key)
        claim = wait_for("its pop claimed the key", lambda: RedisStore(REDIS_URL).inspect(key_of(oid)), timeout=TIMEOUT)
        assert claim["state"] == "claimed" and waiting.id in claim["owner"]
        # When its lease runs out, and a duplicate taken by another worker takes the key over and completes it
        time.sleep(max(0.0, float(claim["lease_until"]) - time.time()) + 0.5)
        tasks.charge_quietly.apply_async((oid, sink.key), queue=other_queue)
        wait_for("the duplicate completed the key", lambda: state_of(key_of(oid)) == "completed", timeout=TIMEOUT)
        assert "took over key" in other.log
        # and the thread is free for the waiting message
        sink.client.rpush(gate, "go")
        wait_for("the waiting message acked", lambda: not unacked(waiting.id), timeout=TIMEOUT)
        wait_for("it was skipped", lambda: "not running it again" in held.log, timeout=TIMEOUT)
    # Then the waiting message did not take its old claim for its own: the key's body ran once
    assert effects(sink) == 2  # the held task's and the duplicate's


def test_a_message_popped_and_given_back_at_shutdown_leaves_its_key_free_or_completed_once(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a threads worker with one thread, busy with a task held at a gate, and a keyed message it popped (and
    # claimed) meanwhile, waiting for the thread
    gate = f"{sink.key}:gate"
    held = shared_worker(queue_name, tmp_path, pool="threads")
    with held:
        tasks.charge_quietly.delay(random.randrange(10**9), sink.key, gate)
        wait_for("the thread held", lambda: effects(sink) == 1, timeout=TIMEOUT)
        waiting = tasks.charge_quietly.delay(oid, sink.key)
        wait_for("its pop claimed the key", lambda: state_of(key_of(oid)) == "claimed", timeout=TIMEOUT)
        # When the worker is asked to stop (a warm shutdown), and then the gate opens
        held.kill(signal.SIGTERM)
        time.sleep(0.5)
        sink.client.rpush(gate, "go")
        held.wait(TIMEOUT)
    # Then the waiting message either ran there once and completed its key, or was given back to its queue with
    # its key let go: never a key left claimed by a delivery that is over
    state = state_of(key_of(oid))
    if state == "completed":
        assert effects(sink) == 2 and not unacked(waiting.id)
    else:
        assert state is None and effects(sink) == 1
        assert waiting_messages("redis", queue_name) == 1 and not unacked(waiting.id)


def test_a_revoked_message_lets_its_claim_go_as_it_is_acked(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a solo worker that knows a task id is revoked
    task_id = uuid.uuid4().hex
    with shared_worker(queue_name, tmp_path) as running:
        celery_app.control.revoke(task_id, destination=[running.hostname])
        wait_for("the revoke received", lambda: "flagged as revoked" in running.log, timeout=TIMEOUT)
        # When a keyed message of that id arrives (its pop claims the key)
        tasks.charge_quietly.apply_async((oid, sink.key), task_id=task_id)
        wait_for("the message acked", lambda: "Discarding revoked task" in running.log, timeout=TIMEOUT)
        wait_for("its ack", lambda: not unacked(task_id), timeout=TIMEOUT)
    # Then its body never ran, and its key is free again (not held until its lease runs out)
    assert effects(sink) == 0
    assert RedisStore(REDIS_URL).inspect(key_of(oid)) is None


def test_a_message_refused_before_idempotency_lets_its_claim_go(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a solo worker that requires a tenant on every guarded message
    with shared_worker(queue_name, tmp_path, tenant_required=True) as running:
        # When a keyed message without one arrives (its pop claims the key; the tenant guard refuses it first)
        result = tasks.charge_quietly.delay(oid, sink.key)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
        wait_for("its refusal", lambda: "MissingTenantError" in running.log, timeout=TIMEOUT)
    # Then its body never ran, and its key is free again
    assert effects(sink) == 0
    assert RedisStore(REDIS_URL).inspect(key_of(oid)) is None


def test_a_key_the_pop_cannot_claim_leaves_the_message_to_the_task(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a key that is not a claim at all in the store (a string where a hash should be: the claim's first read
    # fails with WRONGTYPE, after the pop took the message and recorded it handed out)
    client = redis.Redis.from_url(REDIS_URL)
    client.set(IDEM_PREFIX + key_of(oid), "not a claim")
    try:
        with shared_worker(queue_name, tmp_path) as running:
            # When a message of that key arrives
            result = tasks.charge_quietly.delay(oid, sink.key)
            # Then the pop still hands it to the worker, and the task meets the store's refusal itself (a dead
            # letter, acked): not a pop that fails again each time the message comes back
            wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
            wait_for("the task's own claim refused", lambda: "WRONGTYPE" in running.log, timeout=TIMEOUT)
        assert effects(sink) == 0
        assert "The pop" not in running.log
    finally:
        client.delete(IDEM_PREFIX + key_of(oid))


def test_a_claim_of_another_key_than_the_task_makes_is_let_go(
    celery_app: Any, queue_name: str, sink: Sink, oid: int, tmp_path: Path
) -> None:
    # Given a message whose header names a tenant the worker drops (not a valid tenant id): its pop claims the key
    # under that tenant, the task under none
    with shared_worker(queue_name, tmp_path):
        header = {"v": 1, "idem": f"charge:{oid}", "tenant": "not valid"}
        result = celery_app.send_task(QUIET, args=[oid, sink.key], headers={"guardrails": header})
        wait_for("the key completed", lambda: state_of(key_of(oid)) == "completed", timeout=TIMEOUT)
        wait_for("the message acked", lambda: not unacked(result.id), timeout=TIMEOUT)
    # Then the pop's claim is let go, and the task's own claim is the one completed
    assert RedisStore(REDIS_URL).inspect(key_of(oid, "not valid")) is None
    assert effects(sink) == 1


def test_a_pool_runs_where_it_pops_only_for_solo_and_threads() -> None:
    from celery.concurrency.prefork import TaskPool as Prefork
    from celery.concurrency.solo import TaskPool as Solo

    assert [pop_claims.runs_where_it_pops(pool) for pool in ("solo", "threads", "prefork", "eventlet")] == [
        True,
        True,
        False,
        False,
    ]
    assert pop_claims.runs_where_it_pops(Solo) and not pop_claims.runs_where_it_pops(Prefork)
    assert not pop_claims.runs_where_it_pops(None)


@pytest.mark.parametrize(
    ("pool", "store", "expected"),
    [
        ("solo", "same", True),
        ("threads", "same", True),
        ("prefork", "same", False),
        ("solo", "another database", False),
    ],
)
def test_the_hook_is_given_to_the_workers_own_app_where_its_claims_are_sound(
    pool: str, store: str, expected: bool
) -> None:
    # Given an app on the atomic pop, whose store is the broker's Redis or another database's
    app = Celery(f"pop-{uuid.uuid4().hex[:6]}", broker=REDIS_URL)
    app.conf.broker_transport = atomic_pop.TRANSPORT
    app.conf.guardrails = {"store": REDIS_URL if store == "same" else REDIS_URL.rsplit("/", 1)[0] + "/15"}
    # When its worker starts with that pool
    enabled = pop_claims.enable(app, hostname="celery@here", pool=pool)
    # Then its connections' channels get the hook only where the task runs where its message is popped, on the
    # store that acks; no other app's do
    assert enabled is expected
    assert (pop_claims.claims(app) is not None) is expected
    assert pop_claims.claims(Celery("another", broker=REDIS_URL)) is None
    # And a worker started again without it takes the hook away
    pop_claims.enable(app, hostname="celery@here", pool="prefork")
    assert pop_claims.claims(app) is None


def test_a_pop_claims_with_the_shortest_lease_of_the_keyed_tasks() -> None:
    from celery_guardrails import GuardedTask

    # Given an app whose keyed tasks have a lease of 2 s and the app's (45 s), and an unkeyed task with 1 s (the
    # app also has every shared task of the test process: 20 s at the shortest)
    app = Celery(f"pop-{uuid.uuid4().hex[:6]}", broker=REDIS_URL)
    app.conf.guardrails = {"store": REDIS_URL, "idempotency_lease": 45.0}

    @app.task(base=GuardedTask, name="pop.short", idempotency_key="k:{n}", idempotency_lease=2.0)
    def short(n: int) -> None: ...

    @app.task(base=GuardedTask, name="pop.default", idempotency_key="k:{n}")
    def default(n: int) -> None: ...

    @app.task(base=GuardedTask, name="pop.unkeyed", idempotency_lease=1.0)
    def unkeyed(n: int) -> None: ...

    # Then its pops claim with 2 s: a claim a killed worker leaves never outlives the lease of its task
    assert pop_claims.pop_lease(app) == 2.0


def test_a_pop_s_arguments_carry_the_server_s_time_and_never_raise_with_the_server_gone() -> None:
    # Given the claims of a worker whose store is the real Redis, and one whose store's server is gone (nothing
    # listens on its port: the clock's check, due on the first pop, cannot reach it)
    lease = 30.0
    here = pop_claims.Claims(store=RedisStore(REDIS_URL), hostname="celery@here", lease=lease, retention=60)
    gone = pop_claims.Claims(
        store=RedisStore("redis://127.0.0.1:1/0"), hostname="celery@gone", lease=lease, retention=60
    )
    # When each gives the arguments of a pop
    seconds, micros = redis.Redis.from_url(REDIS_URL).time()
    given = here.arguments()
    fallback = gone.arguments()
    # Then the time is the server's (to the second the store measures its clock by), the lease's end is that time
    # plus the pop's lease, as the claim script stores it, and the retention whole seconds
    for arguments in (given, fallback):
        prefix, _number, lease_until, retention, key_prefix, _longest, header, now = arguments
        assert float(lease_until) == pytest.approx(float(now) + lease, abs=1e-6)
        assert lease_until == f"{float(now) + lease:.6f}" and retention == 60
        assert key_prefix == IDEM_PREFIX and header == "guardrails" and prefix.endswith(":")
    assert abs(float(given[-1]) - (seconds + micros / 1e6)) < 1.5
    # And the store that cannot be reached gave this host's time instead of raising (the pop goes on; its claim is
    # what the store's own claims would make)
    assert abs(float(fallback[-1]) - time.time()) < 1.5
