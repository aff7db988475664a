"""``make bench``: what the guardrails cost, as ratios against plain Celery measured in the same run.

One real ``celery worker`` process (solo pool) per store runs N tasks of each kind, published from this
process; each kind is measured end to end (publish N, wait until every one ran) once in each of BENCH_ROUNDS
rounds (20 unless set), and compared with its plain Celery baseline in the same round (the median of those ratios
is printed, with their range: this machine's speed drifts by more than the differences measured). Workers:

* Redis store: no-op tasks, results stored (plain Celery with early and late acks; GuardedTask; with an
  idempotency key; with a dependency, i.e. a retry budget) and results ignored (``ignore_result=True`` on
  plain and guarded kinds alike: the last task of a batch pushes to a Redis list the publisher waits on).
  It also counts, from Redis' own statistics, the extra commands and round trips (script calls) per task, and
  the server's own CPU time each kind adds to a task.
  The same kinds again on a backlog: the N messages published first (that publish timed apart: the publisher's
  cost per message), then handed to the worker's queue at once; the worker's throughput with the publisher off
  its cores, as a worker meets a queue that backed up.
* Django store on PostgreSQL, in a database made for the run on the local server (BENCH_PG_HOST,
  BENCH_PG_PORT, BENCH_PG_USER) and dropped after it: a task that INSERTs one row, plain Celery in a
  transaction of its own against a GuardedTask without a key doing the same, and a keyed GuardedTask with
  ``atomic=True`` (the key's completion commits in the body's transaction) and without; after the table, the
  keyed kinds over the unkeyed one (the store's own part: the key's statements and their gate).
  BENCH_CONN_MAX_AGE sets Django's CONN_MAX_AGE (default 0). It also counts the database sessions opened per
  task (PostgreSQL's ``pg_stat_database.sessions``).
* Django store on SQLite (a fresh file): the no-op kinds, and the INSERT kinds.

One more Redis-store worker: ``redis_kombu_pop`` pops with kombu's ``BRPOP`` (``broker_atomic_pop`` off; every
kind of the ``redis`` worker, plain ones included, uses the atomic pop). It is another worker process, so its
figures are compared with the ``redis`` worker's by tasks/s of the same kind (not paired by round).

Paired settings (``pair_metrics``, ``pair_activity``): two Redis-store workers that differ by one setting
(``metrics`` on against off; ``activity`` on against off), each on a queue of its own, take turns with the
same kind in every round (which goes first alternates); the figure is the median over rounds of the "off"
worker's time over the "on" worker's (1.00: the setting costs nothing), with its range, over
BENCH_PAIR_ROUNDS rounds (24).

BENCH_STORES defaults to ``redis,redis_peers,redis_kombu_pop,pair_metrics,pair_activity,postgres,postgres_reuse,
postgres_pool,sqlite``. ``redis_peers`` puts a keyed GuardedTask beside celery-once and celery-singleton on the
same Redis and worker, with 20% of the messages duplicates, and prints what each guarantees. ``postgres`` runs
with Celery's default (the Django fixup closes the connections before and after every task), ``postgres_reuse``
with ``CELERY_DB_REUSE_MAX=1000``, ``postgres_pool`` with Django's pool (a solo worker: under prefork Celery
closes the pool with every task, celery/celery#10554). Every ratio has beside it the time the kind adds to each
task over its baseline, in microseconds (median of the rounds' differences).

BENCH_STORES picks workers. Prints ratios; asserts nothing.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("BENCH_TASKS", "500"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "20"))
#: Rounds of a paired comparison: each is short (a kind on two workers), and single rounds vary widely.
PAIR_ROUNDS = int(os.environ.get("BENCH_PAIR_ROUNDS", "24"))
REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
PG = {
    "host": os.environ.get("BENCH_PG_HOST", "127.0.0.1"),
    "port": os.environ.get("BENCH_PG_PORT", "5432"),
    "user": os.environ.get("BENCH_PG_USER", "postgres"),
}


@dataclass(frozen=True)
class Group:
    """Kinds compared with one baseline (the first kind); ``stored``: wait for results, else for ``done``;
    ``duplicates``: every fifth message repeats the one before it (20% duplicates, published while the first
    is still queued or running); ``backlog``: the N messages are published to a list of their own first (that
    publish timed apart), then handed to the worker's queue in one step (Redis ``RENAME``): the worker's
    throughput on a backlog, without the publisher on the same cores. ``over``: pairs of kinds (a kind, the one
    it is also compared with) whose difference is printed after the table, paired by round as every figure is."""

    title: str
    kinds: list[str]
    stored: bool = True
    duplicates: bool = False
    backlog: bool = False
    over: tuple[tuple[str, str], ...] = ()


#: What each kind of the peers' group guarantees, printed beside its speed.
GUARANTEES = {
    "plain": "nothing: every duplicate runs",
    "guarded_key": "a key runs its body once while it is retained (7 days): duplicate publishes, redeliveries "
    "after a crash, retries and replays skip a completed key (the worker checks; duplicates are published)",
    "celery_once": "a duplicate publish is refused while the first is queued or running (a Redis lock, released "
    "as the task returns); a later publish, or a redelivered message, runs again",
    "celery_singleton": "a duplicate publish gets the queued task's result while it is queued or running (a Redis "
    "lock); a later publish, or a redelivered message, runs again",
}


#: The Django store's own part of a keyed task's cost: the keyed kinds over the GuardedTask without a key doing the
#: same INSERT in a transaction of its own (the rest of the guardrails run in both).
KEY_OVER_GUARD = (("guarded_key_atomic_insert", "guarded_insert"), ("guarded_key_insert", "guarded_insert"))

#: Per worker (store): its groups.
WORKERS: dict[str, list[Group]] = {
    "redis": [
        Group(
            "Redis store, results stored",
            ["plain", "plain_acks_late", "guarded", "guarded_key", "guarded_dependency"],
        ),
        Group("Redis store, results ignored", ["plain_ignored", "guarded_ignored", "guarded_key_ignored"], False),
        Group("Redis store, results stored, a backlog", ["plain", "guarded", "guarded_key"], backlog=True),
        Group(
            "Redis store, results ignored, a backlog",
            ["plain_ignored", "guarded_ignored", "guarded_key_ignored"],
            False,
            backlog=True,
        ),
    ],
    "redis_kombu_pop": [
        Group("Redis store, results stored, kombu's BRPOP (broker_atomic_pop off)", ["plain", "guarded"]),
        Group("Redis store, results ignored, kombu's BRPOP", ["plain_ignored", "guarded_ignored"], False),
    ],
    "redis_peers": [
        Group(
            "Keyed tasks against celery-once 3.0.1 and celery-singleton 0.3.1, 20% duplicates, Redis store, "
            "results stored",
            ["plain", "guarded_key", "celery_once", "celery_singleton"],
            duplicates=True,
        ),
    ],
    "postgres": [
        Group(
            "Django store (PostgreSQL), one INSERT per task, connections closed around every task (Celery's default)",
            ["plain_insert", "guarded_insert", "guarded_key_atomic_insert", "guarded_key_insert"],
            over=KEY_OVER_GUARD,
        ),
    ],
    "postgres_reuse": [
        Group(
            "Django store (PostgreSQL), one INSERT per task, CELERY_DB_REUSE_MAX=1000",
            ["plain_insert", "guarded_insert", "guarded_key_atomic_insert", "guarded_key_insert"],
            over=KEY_OVER_GUARD,
        ),
    ],
    "postgres_pool": [
        Group(
            "Django store (PostgreSQL), one INSERT per task, Django's pool (solo worker)",
            ["plain_insert", "guarded_insert", "guarded_key_atomic_insert", "guarded_key_insert"],
            over=KEY_OVER_GUARD,
        ),
    ],
    "sqlite": [
        Group("Django store (SQLite), no-op", ["plain", "guarded_key", "guarded_dependency"]),
        Group("Django store (SQLite), one INSERT per task", ["plain_insert", "guarded_key_atomic_insert"]),
    ],
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisStats:
    """The Redis server's counters so far: commands processed, script calls, and its CPU time (seconds, user and
    system: what the server itself spent, whoever asked)."""

    commands: int
    scripts: int
    cpu: float


def redis_stats(client: Any) -> RedisStats:
    stats = client.info("commandstats")
    scripts = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
    used = client.info("cpu")
    return RedisStats(
        commands=int(client.info("stats")["total_commands_processed"]),
        scripts=int(scripts),
        cpu=float(used["used_cpu_user"]) + float(used["used_cpu_sys"]),
    )


@dataclass
class Measured:
    """One kind's end-to-end seconds in each round; its Redis commands, script calls and database sessions in the
    last."""

    seconds: list[float] = field(default_factory=list)
    #: The Redis server's CPU seconds in each round's batch (its own work for the publisher, the worker and both).
    server_cpu: list[float] = field(default_factory=list)
    #: A backlog's publish, in seconds, in each round (empty: published while the worker ran).
    published: list[float] = field(default_factory=list)
    commands: int = 0
    scripts: int = 0
    sessions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """N tasks of one kind, published and waited for: seconds end to end, and what they cost the services."""

    seconds: float
    commands: int
    scripts: int
    sessions: int
    #: A backlog's publish (seconds), timed apart; 0 otherwise.
    published: float = 0.0
    #: The Redis server's CPU seconds while the batch ran (a backlog's: from the hand-over).
    server_cpu: float = 0.0


def pg_admin(statement: str) -> None:
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **PG) as admin:
        admin.execute(statement)  # a statement made here, not user input


def django_env(store: str, scratch: Path) -> dict[str, str]:
    """The environment of a Django-store worker: bench.settings on a fresh, migrated database."""
    env = {
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "EXAMPLE_VAR_DIR": str(scratch),
        "EXAMPLE_SQLITE_PATH": str(scratch / "bench.sqlite3"),
    }
    if store.startswith("postgres"):
        name = f"guardrails_bench_{uuid.uuid4().hex[:12]}"
        pg_admin(f'CREATE DATABASE "{name}"')
        env.update({"BENCH_PG_NAME": name, "BENCH_PG_HOST": PG["host"], "BENCH_PG_PORT": PG["port"]})
        env["BENCH_PG_USER"] = PG["user"]
    return env


def pg_sessions() -> int:
    """Sessions opened so far on the worker's PostgreSQL database (BENCH_PG_NAME), 0 without one."""
    if not os.environ.get("BENCH_PG_NAME"):
        return 0
    import psycopg

    with psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **PG) as admin:
        found = admin.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = %s", (os.environ["BENCH_PG_NAME"],)
        ).fetchone()
    return int(found[0]) if found else 0


def measure(bench_app: Any, client: Any, group: Group, name: str, first: int, *, queue: str | None = None) -> Batch:
    """Publish N tasks of kind ``name`` (numbered from ``first``; to ``queue``, default the app's) and wait until
    all ran."""
    task = getattr(bench_app, name)
    done = f"bench-done-{uuid.uuid4().hex[:8]}"
    numbers = [first + (i - 1 if group.duplicates and i % 5 == 0 and i else i) for i in range(N)]
    published = 0.0
    if group.backlog:
        # Published to a list the worker does not read, then renamed onto the (empty) list it waits on: Redis
        # wakes the waiting pop, and the worker finds N messages queued.
        target = queue or bench_app.app.conf.task_default_queue
        stage = f"bench-backlog-{uuid.uuid4().hex[:8]}"
        began = time.perf_counter()
        pending = [task.apply_async((n, done if i == N - 1 else ""), queue=stage) for i, n in enumerate(numbers)]
        published = time.perf_counter() - began
        client.delete(f"_kombu.binding.{stage}")
        if client.exists(target):
            raise RuntimeError(f"the worker's queue {target} is not empty before a backlog")
    before = redis_stats(client)
    sessions = pg_sessions()
    start = time.perf_counter()
    if group.backlog:
        client.rename(stage, target)
    else:
        pending = [task.apply_async((n, done if i == N - 1 else ""), queue=queue) for i, n in enumerate(numbers)]
    if group.stored:
        for result in pending:
            result.get(timeout=300)
    elif client.blpop([done], timeout=300) is None:
        raise TimeoutError(f"{name}: the last task did not run within 300 s")
    seconds = time.perf_counter() - start
    after = redis_stats(client)
    client.delete(done)
    # Results unsubscribe from their channels when collected: here, not inside the next kind's measurement
    # (which paid for this kind's unsubscribes).
    del pending
    gc.collect()
    return Batch(
        seconds=seconds,
        commands=after.commands - before.commands,
        scripts=after.scripts - before.scripts,
        server_cpu=after.cpu - before.cpu,
        # (a session's count is flushed when it ends: the worker's open one is counted in the next batch)
        sessions=pg_sessions() - sessions,
        published=published,
    )


#: The guardrails settings of a worker variant (bench/app.py reads them from BENCH_GUARDRAILS).
VARIANTS = {"redis_kombu_pop": {"broker_atomic_pop": False}}
#: The environment of a Django-store variant: connections kept across tasks, or Django's pool.
DATABASE_VARIANTS = {"postgres_reuse": {"BENCH_DB_REUSE_MAX": "1000"}, "postgres_pool": {"BENCH_PG_POOL": "1"}}


def run_worker(store: str, groups: list[Group]) -> dict[str, dict[str, Measured]]:
    """Every kind of ``groups`` measured in every round on one worker process: by group title, by kind."""
    import json

    scratch = Path(tempfile.mkdtemp(prefix="guardrails-bench-"))
    env = {
        **os.environ,
        "BENCH_STORE": "redis" if store.startswith("redis") else "django",
        "BENCH_GUARDRAILS": json.dumps(VARIANTS.get(store, {})),
        "BENCH_QUEUE": f"bench-{uuid.uuid4().hex[:8]}",
        "BENCH_RUN": uuid.uuid4().hex[:8],
        "BENCH_REDIS_URL": REDIS,
        "PYTHONPATH": str(ROOT),
        "EXAMPLE_LOG_LEVEL": "WARNING",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if not store.startswith("redis"):
        env.update(django_env(store, scratch))
        env.update(DATABASE_VARIANTS.get(store, {}))
    try:
        if not store.startswith("redis"):  # the worker sets Django up (Celery's fixup) on the migrated database
            manage = [sys.executable, str(ROOT / "example_project" / "manage.py")]
            subprocess.run([*manage, "migrate", "--run-syncdb", "-v", "0"], env=env, check=True)
        return _run_worker(env, groups)
    finally:
        if env.get("BENCH_PG_NAME"):
            pg_admin(f'DROP DATABASE IF EXISTS "{env["BENCH_PG_NAME"]}" WITH (FORCE)')
        shutil.rmtree(scratch, ignore_errors=True)


def start_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``celery worker -P solo`` of bench.app with ``env`` (its queue, store and settings)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.app",
            "worker",
            "-P",
            "solo",
            "-l",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    os.killpg(worker.pid, signal.SIGTERM)
    worker.wait(30)


def _run_worker(env: dict[str, str], groups: list[Group]) -> dict[str, dict[str, Measured]]:
    os.environ.update({k: env[k] for k in ("BENCH_STORE", "BENCH_QUEUE", "BENCH_RUN", "BENCH_GUARDRAILS")})
    if env.get("BENCH_PG_NAME"):  # its sessions are counted (pg_sessions)
        os.environ["BENCH_PG_NAME"] = env["BENCH_PG_NAME"]
    sys.modules.pop("bench.app", None)  # this run's queue and store (one store per process anyway)
    import redis

    from bench import app as bench_app

    client = redis.Redis.from_url(REDIS)
    worker = start_worker(env)
    try:
        bench_app.plain.delay(0).get(timeout=60)  # the worker is up
        kinds = [(group, name) for group in groups for name in group.kinds]
        results = {group.title: {name: Measured() for name in group.kinds} for group in groups}
        for round_ in range(ROUNDS):
            # Each round starts with another kind: the first measured after a pause ran measurably faster.
            shift = round_ % len(kinds)
            for index, (group, name) in enumerate(kinds[shift:] + kinds[:shift]):
                first = (round_ * len(kinds) + index + 1) * N
                batch = measure(bench_app, client, group, name, first)
                measured = results[group.title][name]
                measured.seconds.append(batch.seconds)
                measured.server_cpu.append(batch.server_cpu)
                if group.backlog:
                    measured.published.append(batch.published)
                measured.commands, measured.scripts = batch.commands, batch.scripts
                measured.sessions = batch.sessions
        return results
    finally:
        stop_worker(worker)


@dataclass(frozen=True)
class Pair:
    """One setting measured paired: the same kinds on two Redis-store workers that differ only by ``on``'s
    settings, one after the other in every round (which goes first alternates)."""

    title: str
    off: dict[str, Any]
    on: dict[str, Any]
    kinds: tuple[Group, ...] = (
        Group("results stored", ["guarded"]),
        Group("results ignored", ["guarded_ignored"], False),
    )


#: The paired comparisons ``make bench`` runs (BENCH_STORES names them as pair_<name>).
PAIRS = {
    "metrics": Pair(title="Prometheus metrics (metrics on against off)", off={}, on={"metrics": True}),
    "activity": Pair(
        title="the activity (activity on against off; metrics off in both)",
        off={"activity": False},
        on={"activity": True},
    ),
}


def run_pair(pair: Pair) -> dict[str, dict[str, list[float]]]:
    """Per kind: the seconds of N tasks on the ``off`` and ``on`` workers in each round."""
    import json

    run = uuid.uuid4().hex[:8]
    envs = {
        side: {
            **os.environ,
            "BENCH_STORE": "redis",
            "BENCH_GUARDRAILS": json.dumps(settings),
            "BENCH_QUEUE": f"bench-{side}-{run}",
            "BENCH_RUN": f"{run}-{side}",
            "BENCH_REDIS_URL": REDIS,
            "PYTHONPATH": str(ROOT),
            "EXAMPLE_LOG_LEVEL": "WARNING",
        }
        for side, settings in (("off", pair.off), ("on", pair.on))
    }
    os.environ.update({k: envs["off"][k] for k in ("BENCH_STORE", "BENCH_QUEUE", "BENCH_RUN")})
    os.environ["BENCH_GUARDRAILS"] = "{}"
    sys.modules.pop("bench.app", None)
    import redis

    from bench import app as bench_app

    client = redis.Redis.from_url(REDIS)
    workers = {side: start_worker(env) for side, env in envs.items()}
    try:
        for env in envs.values():
            bench_app.plain.apply_async((0,), queue=env["BENCH_QUEUE"]).get(timeout=60)  # both are up
        found: dict[str, dict[str, list[float]]] = {
            name: {"off": [], "on": []} for group in pair.kinds for name in group.kinds
        }
        first = N
        for round_ in range(PAIR_ROUNDS):
            sides = ["off", "on"] if round_ % 2 == 0 else ["on", "off"]
            for group in pair.kinds:
                for name in group.kinds:
                    for side in sides:
                        first += N
                        batch = measure(bench_app, client, group, name, first, queue=envs[side]["BENCH_QUEUE"])
                        found[name][side].append(batch.seconds)
        return found
    finally:
        for worker in workers.values():
            stop_worker(worker)


def report_pair(pair: Pair, found: dict[str, dict[str, list[float]]]) -> None:
    """Per kind: throughput with the setting on over off, paired by round (median, range)."""
    print(f"\nPaired: {pair.title}, Redis store, two workers taking turns in each round")
    print(f"{'kind':<26} {'off tasks/s':>11} {'on tasks/s':>10} {'on/off':>7} {'(range)':>11}")
    for name, sides in found.items():
        ratios = [off / on for off, on in zip(sides["off"], sides["on"], strict=True)]
        print(
            f"{name:<26} {N / min(sides['off']):>11.0f} {N / min(sides['on']):>10.0f} "
            f"{statistics.median(ratios):>7.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>11}"
        )


def report(group: Group, results: dict[str, Measured], *, counts: bool, sessions: bool = False) -> None:
    """Per kind: its best time; throughput as the median over rounds of the baseline's time over its time in
    the same round (paired, so a slow spell of the machine slows both), with the lowest and highest."""
    base = results[group.kinds[0]]
    print(f"\n{group.title} (against {group.kinds[0]})")
    print(
        f"{'kind':<26} {'best s':>7} {'tasks/s':>8} {'throughput':>10} {'(range)':>11} {'+us/task':>8}"
        + (f" {'+cmds/task':>10} {'+round trips/task':>17} {'+server us/task':>15}" if counts else "")
        + (f" {'sessions/task':>13}" if sessions else "")
        + (f" {'publish us/task':>15} {'+publish us':>10}" if group.backlog else "")
    )
    for name in group.kinds:
        kind = results[name]
        ratios = [b / s for b, s in zip(base.seconds, kind.seconds, strict=True)]
        # The time this kind adds to each task over the baseline, in microseconds, paired by round (median).
        added = [(s - b) / N * 1e6 for b, s in zip(base.seconds, kind.seconds, strict=True)]
        best = min(kind.seconds)
        line = (
            f"{name:<26} {best:>7.3f} {N / best:>8.0f} {statistics.median(ratios):>10.2f} "
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11} {statistics.median(added):>8.0f}"
        )
        if counts:
            # The Redis server's own CPU time this kind adds to a task (median of the rounds' differences).
            server = [(k - b) / N * 1e6 for b, k in zip(base.server_cpu, kind.server_cpu, strict=True)]
            line += f" {(kind.commands - base.commands) / N:>10.2f} {(kind.scripts - base.scripts) / N:>17.2f}"
            line += f" {statistics.median(server):>15.0f}"
        if sessions:
            line += f" {kind.sessions / N:>13.2f}"
        if group.backlog:  # the publish, timed apart: the publisher's cost per message, and what the kind adds
            extra = [(s - b) / N * 1e6 for b, s in zip(base.published, kind.published, strict=True)]
            line += f" {statistics.median(kind.published) / N * 1e6:>15.0f} {statistics.median(extra):>10.0f}"
        print(line)
    for name, other in group.over:
        added = [(s - o) / N * 1e6 for o, s in zip(results[other].seconds, results[name].seconds, strict=True)]
        print(f"{name} over {other}: {statistics.median(added):+.0f} us/task (median of the rounds)")


def pg_answers() -> bool:
    try:
        pg_admin("SELECT 1")
    except Exception as exc:
        print(f"\nDjango store (PostgreSQL): skipped, no PostgreSQL on {PG['host']}:{PG['port']} ({exc})")
        return False
    return True


def main() -> None:
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) == 3 and sys.argv[1] == "--store":  # one store, in a process of its own
        store = sys.argv[2]
        if store.startswith("pair_"):
            pair = PAIRS[store.removeprefix("pair_")]
            report_pair(pair, run_pair(pair))
            sys.stdout.flush()
            return
        if store.startswith("postgres") and not pg_answers():
            return
        results = run_worker(store, WORKERS[store])
        for group in WORKERS[store]:
            report(group, results[group.title], counts=store.startswith("redis"), sessions=store.startswith("postgres"))
            if group.duplicates:
                print("what each guarantees:")
                for name in group.kinds:
                    print(f"  {name:<17} {GUARANTEES[name]}")
        sys.stdout.flush()
        return
    default = (
        "redis,redis_peers,redis_kombu_pop,pair_metrics,pair_activity,postgres,postgres_reuse,postgres_pool,sqlite"
    )
    stores = [s for s in os.environ.get("BENCH_STORES", default).split(",") if s]
    print(
        f"{N} tasks per kind, one `celery worker -P solo` process per store, broker and results on {REDIS}; "
        f"{ROUNDS} rounds ({PAIR_ROUNDS} for the paired settings)",
        flush=True,
    )
    for store in stores:
        subprocess.run([sys.executable, __file__, "--store", store], check=True)
    print(
        "\nthroughput: the baseline's end-to-end time over this kind's in the same round on the same worker "
        "(1.00 = as fast), median over the rounds (range: lowest-highest). 'a backlog': timed from the moment N "
        "published messages are handed to the worker's queue to the last one's end (the publish timed apart)."
    )
    print("GuardedTask acks late: 'plain_acks_late' separates the cost of that policy from the guardrails'.")
    print("Publisher, worker and services share this machine's cores: single rounds differ widely; read the median.")


if __name__ == "__main__":
    main()
