"""Resumable chunks (``self.checkpoint.iterate``) on real workers: a job SIGKILLed half way resumes where it
stopped; on the Django store each item's row commits exactly once, on the Redis store at most one chunk runs
again; a retry resumes; a store cut while saving spends no attempt; misuse is a clear error."""

from __future__ import annotations

import json
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from celery_guardrails.exceptions import CheckpointError, ConfigurationError
from celery_guardrails.stores.base import StoredCheckpoint
from django_celery_guardrails.store import DjangoStore
from tests.conftest import Sink
from tests.proj import django_tasks
from tests.support.proxy import TcpProxy
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env, quick_redelivery
from tests.testapp.models import ChunkItem

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 90
COUNT = 10_000
#: The Redis store variant's job (its rows commit one by one).
SHORT = 2_000
EVERY = 100
# Redeliveries come back quickly after a SIGKILL; the claim's lease is short, so its heartbeat must keep it.
TRANSPORT = json.dumps(quick_redelivery())


@pytest.fixture
def job(sink: Sink) -> Iterator[str]:
    job = f"job-{uuid.uuid4().hex[:12]}"
    yield job
    sink.client.delete(f"{job}:runs", f"{job}:gate", f"{job}:at-gate")


def rows(job: str) -> int:
    return ChunkItem.objects.filter(job=job).count()


def items_by_run(job: str) -> dict[int, list[int]]:
    written: dict[int, list[int]] = defaultdict(list)
    for run, item in ChunkItem.objects.filter(job=job).order_by("item", "run").values_list("run", "item"):
        written[run].append(item)
    return dict(written)


def lease_renewed(sink: Sink, store: Any) -> bool:
    """Whether the running job's claim (2 s lease) was renewed by its heartbeat while the chunks ran: it ends
    later than the lease the claim took as the body started (the first renewal is due a third of the lease
    after the claim: waited for, never assumed from the rows written)."""
    report = sink.items()[0]
    started = datetime.fromisoformat(report["started"]).timestamp()
    row = store.inspect(report["key"])
    assert row is not None and row["state"] == "claimed", (report, row)
    until = row["lease_until"]
    until = float(until) if isinstance(until, str) else until.timestamp()
    return bool(until > started + 2.0)


def kill_half_way(
    job: str,
    env: dict[str, str],
    queue: str,
    tmp_path: Path,
    sink: Sink,
    *,
    store: Any,
    done: Any,
    count: int = COUNT,
    pause: float = 0.0003,
    **options: Any,
) -> Any:
    """Publish the job (``count`` items), SIGKILL its worker once about half the rows are in, restart a worker;
    the job's result (after it completes on the second worker, and ``done()`` holds) and the rows there were
    at the kill."""
    result = django_tasks.insert_items.apply_async(
        (job, count), {"every": EVERY, "pause": pause, "sink": sink.key}, **options
    )
    with WorkerProcess(app=PROJ_APP, queue=queue, log_path=tmp_path / "first.log", env=env) as first:
        wait_for("half the rows", lambda: rows(job) >= count // 2, timeout=TIMEOUT)
        if connection.vendor != "sqlite" or not isinstance(store, DjangoStore):
            # (On SQLite the chunks' transactions hold the one write lock back to back: the heartbeat thread's
            # UPDATE waits for a gap, and may get none before the job ends. PostgreSQL locks rows.)
            wait_for("the claim's lease renewed by its heartbeat", lambda: lease_renewed(sink, store), timeout=TIMEOUT)
        first.kill()
        first.wait(15)
    at_kill = rows(job)
    with WorkerProcess(app=PROJ_APP, queue=queue, log_path=tmp_path / "second.log", env=env) as second:
        outcome = result.get(timeout=TIMEOUT)
        assert "resuming" in second.log
        # (the checkpoint is cleared as the task succeeds, after Celery stored its result)
        wait_for("the job's checkpoint cleared", done)
    return outcome, at_kill


def test_django_store_sigkill_half_way_resumes_and_writes_every_item_exactly_once(
    celery_app: Any, queue_name: str, sink: Sink, job: str, tmp_path: Path
) -> None:
    from django_celery_guardrails.models import Checkpoint, IdempotencyKey
    from django_celery_guardrails.store import DjangoStore

    # Given a keyed chunked job over 10,000 items (one INSERT each, no unique constraint) on the Django store,
    # its claim's lease 2 s (renewed by the heartbeat while the chunks run)
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": "django", "idempotency_lease": 2.0}),
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=TRANSPORT,
    )
    key = f"tests.proj.django_tasks.insert_items:-:chunked:{job}"
    # When its worker is SIGKILLed once about half the rows are in, and a worker is started again
    outcome, at_kill = kill_half_way(
        job,
        env,
        queue_name,
        tmp_path,
        sink,
        idempotency_key=f"chunked:{job}",
        store=DjangoStore(),
        done=lambda: not Checkpoint.objects.filter(key=key).exists(),
    )
    # Then it was killed mid-job: the rows committed at the kill are whole chunks
    assert COUNT // 2 <= at_kill < COUNT and at_kill % EVERY == 0
    # And after the restart every item has exactly one row
    per_item = Counter(ChunkItem.objects.filter(job=job).values_list("item", flat=True))
    assert sorted(per_item) == list(range(COUNT)) and set(per_item.values()) == {1}
    # And the first run wrote the items before the kill, the second only the rest, starting from the checkpoint
    assert items_by_run(job) == {1: list(range(at_kill)), 2: list(range(at_kill, COUNT))}
    assert [(r["run"], r["start"]) for r in sink.items()] == [(1, 0), (2, at_kill)]
    # And the running sum in the checkpoint's state resumed with the position: it counts each item once
    assert outcome == {"sum": sum(range(COUNT)), "start": at_kill, "run": 2}
    # And the checkpoint was the job's idempotency key, now completed (and the checkpoint cleared)
    assert sink.items()[0]["key"] == key
    assert IdempotencyKey.objects.get(key=key).state == "completed"


def test_redis_store_sigkill_half_way_resumes_repeating_at_most_one_chunk(
    celery_app: Any, queue_name: str, sink: Sink, job: str, tmp_path: Path
) -> None:
    # Given the same job over 2,000 items on the Redis store: each INSERT commits on its own (one disk flush
    # each: slower), the position is saved after each chunk
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": REDIS_URL, "idempotency_lease": 2.0}),
        GUARDRAILS_TEST_TRANSPORT_OPTIONS=TRANSPORT,
    )
    from celery_guardrails.stores.redis import RedisStore
    from celery_guardrails.stores.redis_checkpoint import checkpoint_key

    key = checkpoint_key(f"tests.proj.django_tasks.insert_items:-:chunked:{job}")
    # When its worker is SIGKILLed half way and a worker is started again
    outcome, at_kill = kill_half_way(
        job,
        env,
        queue_name,
        tmp_path,
        sink,
        idempotency_key=f"chunked:{job}",
        store=RedisStore(REDIS_URL),
        count=SHORT,
        pause=0.002,  # about 4 s in all: the claim's heartbeat (every 0.67 s) renews it before the job ends
        done=lambda: not sink.client.exists(key),
    )
    resumed = outcome["start"]
    # Then the second run started at the last saved chunk boundary, at most one chunk behind the kill
    assert resumed % EVERY == 0 and at_kill - EVERY <= resumed <= at_kill
    assert items_by_run(job) == {1: list(range(at_kill)), 2: list(range(resumed, SHORT))}
    # And every item has a row; only the items of the chunk cut short have two (at most one chunk)
    per_item = Counter(ChunkItem.objects.filter(job=job).values_list("item", flat=True))
    assert sorted(per_item) == list(range(SHORT))
    assert sorted(item for item, n in per_item.items() if n > 1) == list(range(resumed, at_kill))
    # And the state saved with the position made the sum right anyway
    assert outcome["sum"] == sum(range(SHORT))


#: The kit's project on the Django store, and on the Redis store (tests/kit_proj).
DJANGO_KIT, REDIS_KIT = "tests.kit_proj.app:app", "tests.kit_proj.redis_store:app"
#: The finding's job: 600 items in chunks of 100.
ITEMS = 600


def stored_checkpoint(store: str, key: str) -> StoredCheckpoint | None:
    """The checkpoint of ``key`` in the kit's store as it stands, None when there is none."""
    if store == "django":
        found = DjangoStore().load_checkpoint(key)
        return found if found != StoredCheckpoint() else None
    from celery_guardrails.stores.redis import RedisStore
    from celery_guardrails.stores.redis_checkpoint import checkpoint_key

    redis_store = RedisStore(REDIS_URL)
    return redis_store.load_checkpoint(key) if redis_store.client.exists(checkpoint_key(key)) else None


@pytest.mark.parametrize(
    ("pool", "store"),
    [
        pytest.param("solo", "django", marks=pytest.mark.guardrails(app=DJANGO_KIT, pool="solo")),
        pytest.param("prefork", "django", marks=pytest.mark.guardrails(app=DJANGO_KIT, pool="prefork", concurrency=2)),
        pytest.param("solo", "redis", marks=pytest.mark.guardrails(app=REDIS_KIT, pool="solo")),
    ],
)
@pytest.mark.guardrails  # (on the function too: it turns the kit on as the test is collected)
def test_a_worker_killed_after_the_success_before_the_ack_runs_no_item_again(
    pool: str, store: str, guarded_worker: Any
) -> None:
    from celery_guardrails.testing import assert_single_effect, crash_mid_task
    from tests.kit_proj import redis_store, tasks

    chunks, chunks_keyed = (
        (tasks.chunks, tasks.chunks_keyed) if store == "django" else (redis_store.chunks, redis_store.chunks_keyed)
    )
    # Given chunked jobs of 600 items (chunks of 100), one without an idempotency key (its checkpoint keyed by
    # its task id) and one with a key, on a real worker of the given pool and store
    plain, keyed = f"plain-{uuid.uuid4().hex[:10]}", f"keyed-{uuid.uuid4().hex[:10]}"
    # When each one's worker is SIGKILLed after the body returned and the success hooks ran, before the ack
    # (in prefork the hooks run in the child, the ack in the main process: the whole worker dies), and the
    # message comes back to a restarted worker
    first = crash_mid_task(chunks, plain, ITEMS, at="after_body")
    second = crash_mid_task(chunks_keyed, keyed, ITEMS, at="after_body")
    # Then each job ran to its end once, was killed once, and its redelivery ended
    assert (first.crashes, second.crashes) == (1, 1)
    # And the job without a key found its checkpoint done: the redelivery ran none of the items (on main's code
    # the success hook had deleted it, and the redelivery started again at item 0: 1,200 rows for 600 items)
    assert_single_effect(ChunkItem.objects.filter(job=plain), expected=ITEMS)
    per_item = Counter(ChunkItem.objects.filter(job=plain).values_list("item", flat=True))
    assert sorted(per_item) == list(range(ITEMS)) and set(per_item.values()) == {1}
    assert first.outcomes == [("succeeded", "")]
    key = f"{chunks.name}:-:task-id:{first.task_id}"
    assert f"{key} already completed" in guarded_worker.log
    assert stored_checkpoint(store, key) == StoredCheckpoint(position=ITEMS, done=True)
    # And the keyed job's redelivery was skipped as a duplicate of its completed key (its checkpoint cleared)
    assert second.outcomes == [("duplicate_skipped", "completed")]
    assert_single_effect(ChunkItem.objects.filter(job=keyed), expected=ITEMS)
    assert stored_checkpoint(store, f"{chunks_keyed.name}:-:chunks:{keyed}") is None


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    return celery_app


def test_a_transient_error_mid_job_retries_and_resumes_from_the_last_checkpoint(
    celery_worker: Any, sink: Sink, job: str
) -> None:
    from django_celery_guardrails.models import Checkpoint

    # Given an unkeyed chunked job (its checkpoint keyed by the task id) that fails transiently at item 250
    result = django_tasks.insert_items.delay(job, 1000, every=EVERY, fail_at=250, sink=sink.key)
    # When it is retried
    assert result.get(timeout=TIMEOUT)["sum"] == sum(range(1000))
    # Then the failing chunk [200, 300) was rolled back, and the retry (attempt 2) resumed at 200
    reports = sink.items()
    assert [(r["run"], r["attempt"], r["start"]) for r in reports] == [(1, 1, 0), (2, 2, 200)]
    assert reports[0]["key"] == reports[1]["key"] == f"tests.proj.django_tasks.insert_items:-:task-id:{result.id}"
    assert items_by_run(job) == {1: list(range(200)), 2: list(range(200, 1000))}
    # and the checkpoint is marked done, not deleted (by the success hook, which Celery runs after it stores the
    # result): a job without a key has nothing else to tell a redelivery before the ack that it is done
    wait_for(
        "the checkpoint marked done",
        lambda: Checkpoint.objects.filter(key=reports[0]["key"], completed_at__isnull=False, position=1000).exists(),
    )


@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("generator", CheckpointError),
        ("set", CheckpointError),
        ("every", CheckpointError),
        ("twice", CheckpointError),
        ("state", CheckpointError),
        ("transaction", CheckpointError),
    ],
)
def test_misuse_is_a_clear_error(celery_worker: Any, how: str, error: type[Exception]) -> None:
    # Given a body that misuses the checkpoint, When it runs, Then it fails with a CheckpointError (permanent:
    # not retried), saying what is wrong
    with pytest.raises(error) as raised:
        django_tasks.iterate_badly.delay(how).get(timeout=TIMEOUT)
    assert "checkpoint" in str(raised.value)


def test_atomic_true_is_refused(celery_app: Any, celery_worker: Any) -> None:
    # Given atomic=True (the whole body one transaction: no chunk could commit on its own)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "atomic": True}
    # When a body iterates, Then it fails with a ConfigurationError naming atomic
    with pytest.raises(ConfigurationError, match="atomic"):
        django_tasks.iterate_badly.delay("none").get(timeout=TIMEOUT)


def test_outside_a_task_run_is_a_clear_error() -> None:
    with pytest.raises(CheckpointError, match="only available inside the body"):
        django_tasks.insert_items.checkpoint.iterate(range(3))


def test_database_cut_while_saving_a_checkpoint_rolls_the_chunk_back_and_spends_no_attempt(
    celery_app: Any, queue_name: str, sink: Sink, job: str, tmp_path: Path
) -> None:
    from django_celery_guardrails.models import DeadLetter

    if connection.vendor != "postgresql":
        pytest.skip("needs a database server to take away (runs in the PostgreSQL pass)")
    proxy = TcpProxy(5432)
    env = proj_env(
        queue=queue_name,
        django=True,
        GUARDRAILS_TEST_DB_PORT=str(proxy.port),
        GUARDRAILS_TEST_GUARDRAILS=json.dumps({"store": "django"}),
    )
    try:
        with WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env) as worker:
            # Given a chunked job waiting at a gate after the last item of its second chunk [100, 200)
            result = django_tasks.insert_items.delay(job, 300, every=EVERY, gate_at=199, sink=sink.key)
            wait_for("the job at its gate", lambda: sink.client.llen(f"{job}:at-gate"))
            # When the database goes away just before that chunk's checkpoint is saved
            proxy.cut()
            sink.client.rpush(f"{job}:gate", "go")
            wait_for("the outage logged", lambda: "the guardrails store is unavailable" in worker.log)
            proxy.restore()
            # Then the message came back later and completed
            assert result.get(timeout=TIMEOUT)["sum"] == sum(range(300))
    finally:
        proxy.close()
    # And the chunk cut short was rolled back with its position: the next run redid it from 100, no attempt spent
    reports = sink.items()
    assert [(r["run"], r["attempt"], r["start"]) for r in reports] == [(1, 1, 0), (2, 1, 100)]
    assert items_by_run(job) == {1: list(range(100)), 2: list(range(100, 300))}
    assert not DeadLetter.objects.filter(task_id=result.id).exists()
