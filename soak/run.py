"""``make soak``: N logical jobs through real workers while the soak breaks what they stand on; then counts.

Per store (Django store with ``atomic=True``, Redis store), in a process of its own: a Redis of the soak's own
as broker (append-only file; restarted once), a PostgreSQL cluster of its own (restarted once), two prefork
workers (``-c 2``) SIGKILLed in turn every ``--kill-every`` seconds (main process and children) and restarted
by the soak's supervisor, the store cut for ``--store-cut`` seconds through a TCP forwarder. The jobs
(``soak/app.py``): 1% poison, 2% permanent, 10% transient, the rest ok; 20% of them published twice. When
every job has settled, the permanent ones are "fixed" and their dead letters replayed. Then it prints, per
kind: lost, doubled, dead letters expected and found by reason, keys left claimed, duplicates the replay
added, and the workers' deaths and their causes; and exits non-zero on any loss, any doubled effect with the
Django store, any misfiled dead letter, a key left claimed, or a duplicate added by the replay.

``--broker rabbitmq`` runs the same on the machine's RabbitMQ (a queue of its own; the broker is not
restarted); with ``--queue-type quorum`` the queue is a quorum queue on an exchange of its own, ``--exchange
topic`` (Celery's native delayed delivery carries the retries' countdowns), ``direct`` (the worker holds them) or
``both``. ``--short`` is the suite's version: a few hundred jobs, one kill, one store cut, on the machine's
PostgreSQL (a database of its own) instead of a private cluster.

Every run of a job's body is counted (``runs.log``): a job run more than :data:`LOOP_LIMIT` times fails the soak
(a requeue loop), whatever its outcome.

On the Redis store a job's key does not commit with its effect: a failure after its marked INSERT (a COMMIT cut
off by the database's restart) may have acted, and the retry gate ends it ``not_idempotent``, rightly. The soak
does what its owner would (:data:`AMBIGUOUS`): it looks for the job's effect, replays the records of the jobs
without one with ``allow_not_idempotent=True`` beside the permanent ones, and counts them (``ambiguous``,
``ambiguous_replayed``). On the Django store (``atomic=True``) such a record is misfiled.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("ok", "transient", "later", "permanent", "poison")
#: Share of the logical jobs of each kind (the rest are ``ok``) and of those published twice.
MIX = {"poison": 0.01, "permanent": 0.02, "transient": 0.10, "later": 0.05}
#: Kinds whose jobs must end with their effect (``permanent`` after the replay).
EFFECT_KINDS = ("ok", "transient", "later", "permanent")
#: Runs of one job's body past which the soak calls it a loop: a poison job published twice runs at most
#: 2 x (max_deliveries + 1) = 8 times; a transient or later one 3 times per copy, plus the kills' redeliveries.
LOOP_LIMIT = 12
TWICE = 0.20
#: The dead-letter reason each kind must end with (``ok`` and ``transient`` must end with none).
EXPECTED_REASON = {"permanent": "permanent", "poison": "poison"}
#: The reason of a job failed after its marked effect, which may have acted (the Redis store only; see above).
AMBIGUOUS = "not_idempotent"


@dataclass
class Options:
    jobs: int = 10_000
    store: str = "django"
    broker: str = "redis"
    #: RabbitMQ: ``classic`` (the queue Celery declares) or ``quorum`` (on an exchange of type ``exchange``).
    queue_type: str = "classic"
    exchange: str = "topic"
    kill_every: float = 20.0
    kills: int = 0  # with --short: this many kills, at progress marks, instead of every kill_every seconds
    broker_restart: bool = True
    db_restart: bool = True
    store_cut: float = 10.0
    private_db: bool = True
    visibility_timeout: float = 30.0
    settle_timeout: float = 1500.0
    #: Seconds between two of the three checks that the broker holds nothing more for the queue.
    drain_interval: float = 2.0
    seed: int = 13
    kombu_pop: bool = False
    #: The workers' pool: ``prefork``, or ``threads`` (where the store on the broker acks and the pop claims).
    pool: str = "prefork"
    workdir: str = ""


@dataclass
class Death:
    worker: str
    cause: str


@dataclass
class Result:
    store: str
    broker: str
    jobs: int
    messages: int
    queue_type: str = "classic"
    exchange: str = ""
    seconds: float = 0.0
    per_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    claimed_keys: int = 0
    #: The jobs whose keys were left claimed (at most 100 named).
    claimed_jobs: list[str] = field(default_factory=list)
    replayed: int = 0
    replay_duplicates: int = 0
    #: Redis store: jobs ended ``not_idempotent`` after their marked effect, and those of them replayed (no effect).
    ambiguous: int = 0
    ambiguous_replayed: int = 0
    #: Runs of the jobs' bodies, all told, and the most for one job (and which).
    runs: int = 0
    most_runs: int = 0
    most_runs_job: str = ""
    killed: int = 0
    deaths: list[Death] = field(default_factory=list)
    lost_causes: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def plan_jobs(n: int, seed: int) -> tuple[dict[str, str], list[str]]:
    """(kind of each job, the messages to publish in order: a job id per message)."""
    rng = random.Random(seed)
    ids = [f"j{i:06d}" for i in range(n)]
    kinds = ["ok"] * n
    counts = {kind: max(1, round(n * share)) for kind, share in MIX.items()}
    chosen = rng.sample(range(n), sum(counts.values()))
    for kind, count in counts.items():
        for index in chosen[:count]:
            kinds[index] = kind
        chosen = chosen[count:]
    messages = ids + rng.sample(ids, round(n * TWICE))
    rng.shuffle(messages)
    return dict(zip(ids, kinds, strict=True)), messages


class Supervisor:
    """Keeps two ``celery worker`` processes running; restarts any that exits; tells the soak's kills from
    deaths of their own, with the cause read from the worker's log."""

    def __init__(self, *, env: dict[str, str], queue: str, logs: Path, slots: int = 2, pool: str = "prefork") -> None:
        self.env, self.queue, self.logs, self.pool = env, queue, logs, pool
        self.slots: list[subprocess.Popen[bytes] | None] = [None] * slots
        self.generation = [0] * slots
        self.killed_by_us: set[int] = set()
        self.kills = 0
        self.deaths: list[Death] = []
        self.running = True
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _log(self, slot: int) -> Path:
        return self.logs / f"worker{slot}-{self.generation[slot]}.log"

    def _spawn(self, slot: int) -> None:
        self.generation[slot] += 1
        with self._log(slot).open("wb") as out:
            self.slots[slot] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "soak.app",
                    "worker",
                    "-P",
                    self.pool,
                    "-c",
                    "2",
                    "-Q",
                    self.queue,
                    "-n",
                    f"soak{slot}-{self.generation[slot]}-{uuid.uuid4().hex[:4]}@%h",
                    "-l",
                    "WARNING",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start(self) -> None:
        for slot in range(len(self.slots)):
            self._spawn(slot)
        self.thread.start()

    def kill(self, slot: int) -> None:
        """SIGKILL the worker's whole process group: its main process and its pool children."""
        with self.lock:
            process = self.slots[slot]
            if process is None or process.poll() is not None:
                return
            self.killed_by_us.add(process.pid)
            self.kills += 1
            os.killpg(process.pid, signal.SIGKILL)

    def _watch(self) -> None:
        while self.running:
            with self.lock:
                for slot, process in enumerate(self.slots):
                    if process is None or process.poll() is None or not self.running:
                        continue
                    if process.pid not in self.killed_by_us:
                        self.deaths.append(Death(f"worker{slot}-{self.generation[slot]}", death_cause(self._log(slot))))
                    self._spawn(slot)
            time.sleep(0.2)

    def stop(self) -> None:
        """Warm shutdown: every worker finishes (or gives back) what it holds."""
        self.running = False
        self.thread.join(5)
        for process in self.slots:
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.slots:
            if process is None:
                continue
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def death_cause(log: Path) -> str:
    """The last line of the log that says why the worker stopped (its exit code when none does)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for pattern in (r"Unrecoverable error: .*", r"\w+Error: .*", r"Traceback.*"):
        found = re.findall(pattern, text)
        if found:
            return found[-1][:200]
    return "exited without saying why"


class Chaos(threading.Thread):
    """Periodic kills (or ``kills`` at progress marks) and the one-off events at progress marks."""

    def __init__(self, *, options: Options, supervisor: Supervisor, progress: Any, events: list[tuple]) -> None:
        super().__init__(daemon=True)
        self.options, self.supervisor, self.progress = options, supervisor, progress
        self.events = sorted(events, key=lambda event: event[0])  # (fraction of jobs settled, name, action)
        self.log: list[str] = []
        self.finished = threading.Event()
        self.stopping = threading.Event()

    def note(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        self.log.append(line)
        print(f"  {line}", flush=True)

    def run(self) -> None:
        options, slot = self.options, 0
        marks = [(index + 1) / (options.kills + 1) * 0.6 for index in range(options.kills)]
        next_kill = time.monotonic() + options.kill_every
        while not self.stopping.is_set() and (self.events or marks or not options.kills):
            done = self.progress()
            if self.events and done >= self.events[0][0]:
                _, name, action = self.events.pop(0)
                self.note(f"{name} ({done:.0%} settled)")
                action()
                self.note(f"{name}: over")
            kill_now = (marks and done >= marks[0]) or (not options.kills and time.monotonic() >= next_kill)
            if kill_now:
                if marks:
                    marks.pop(0)
                next_kill = time.monotonic() + options.kill_every
                self.note(f"SIGKILL worker{slot} ({done:.0%} settled)")
                self.supervisor.kill(slot)
                slot = (slot + 1) % len(self.supervisor.slots)
            self.stopping.wait(0.5)
        self.finished.set()


def run_variant(options: Options) -> Result:
    """One store, one broker: set the stage, publish, break things, settle, replay, count."""
    from soak.services import PrivatePostgres, PrivateRedis, TcpProxy

    name = f"{options.store}-store-{options.broker}" + (
        f"-quorum-{options.exchange}" if options.queue_type == "quorum" else ""
    )
    workdir = Path(options.workdir) / name if options.workdir else Path(tempfile.mkdtemp(prefix=f"soak-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "fixed").unlink(missing_ok=True)
    (workdir / "runs.log").unlink(missing_ok=True)
    kinds, messages = plan_jobs(options.jobs, options.seed)
    result = Result(
        store=options.store,
        broker=options.broker,
        jobs=options.jobs,
        messages=len(messages),
        queue_type=options.queue_type,
        exchange=options.exchange if options.queue_type == "quorum" else "",
    )
    queue = f"soak-{uuid.uuid4().hex[:8]}"
    stack: list[Any] = []  # what to stop at the end, last first
    try:
        broker = None
        if options.broker == "redis":
            broker = PrivateRedis(workdir=workdir / "broker").start()
            stack.append(broker)
            broker_url = broker.url
        else:
            broker_url = "amqp://guest:guest@127.0.0.1:5672//"
        if options.private_db:
            database: Any = PrivatePostgres(workdir).start()
            stack.append(database)
            db_port, db_name = database.port, "postgres"
        else:
            database, db_port, db_name = None, 5432, f"soak_{uuid.uuid4().hex[:8]}"
            _psql(5432, "postgres", f'CREATE DATABASE "{db_name}"')
            stack.append(SharedDatabase(db_name))
        store_redis = None
        if options.store == "redis":
            store_redis = PrivateRedis(workdir=workdir / "store").start()
            stack.append(store_redis)
        # The workers reach the store through the forwarder the soak cuts: the database itself for the
        # Django store, the store's Redis for the Redis store.
        # --store broker: the Redis store is the broker's own database, one URL for both in the workers, through
        # the forwarder (the store's cut cuts their broker too): the ack on the store and the claim with the pop.
        on_broker = options.store == "broker"
        if on_broker and broker is None:
            raise SystemExit("soak: --store broker needs the Redis broker")
        redis_store = broker if on_broker else store_redis
        cut_target = db_port if options.store == "django" else redis_store.port  # type: ignore[union-attr]
        forwarder = TcpProxy(cut_target)
        stack.append(forwarder)
        store_url = "django" if options.store == "django" else f"redis://127.0.0.1:{forwarder.port}/0"
        worker_db_port = forwarder.port if options.store == "django" else db_port
        base_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "soak.settings",
            "SOAK_BROKER_URL": broker_url,
            "SOAK_QUEUE": queue,
            "SOAK_DIR": str(workdir),
            "SOAK_DB_NAME": db_name,
            "SOAK_VISIBILITY_TIMEOUT": str(options.visibility_timeout),
            "SOAK_KOMBU_POP": "1" if options.kombu_pop else "0",
            "SOAK_QUEUE_TYPE": options.queue_type,
            "SOAK_EXCHANGE": options.exchange,
        }
        worker_env = {**base_env, "SOAK_DB_PORT": str(worker_db_port), "SOAK_STORE": store_url}
        if on_broker:
            worker_env["SOAK_BROKER_URL"] = store_url
        # This process: Django on the database directly (never cut), the store's Redis directly.
        store_redis_url = redis_store.url if redis_store is not None else None
        direct_store = "django" if store_redis_url is None else store_redis_url
        os.environ.update({**base_env, "SOAK_DB_PORT": str(db_port), "SOAK_STORE": direct_store})
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v", "0"], env=os.environ.copy(), check=True, cwd=ROOT
        )
        _psql(
            db_port,
            db_name,
            "CREATE TABLE soak_effect (id bigserial PRIMARY KEY, job text NOT NULL, kind text NOT NULL, "
            "attempt int NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT now())",
        )
        from soak import app as soak_app

        counter = Counter(kinds, broker=options.broker, queue=queue, drain_interval=options.drain_interval)
        supervisor = Supervisor(env=worker_env, queue=queue, logs=workdir, pool=options.pool)
        supervisor.start()
        stack.append(supervisor)
        start = time.monotonic()
        print(
            f"soak [{options.store} store, {options.broker} broker]: {options.jobs} jobs, {len(messages)} messages; "
            f"logs in {workdir}",
            flush=True,
        )

        def cut_store() -> None:
            forwarder.cut()
            time.sleep(options.store_cut)
            forwarder.restore()

        events: list[tuple] = []
        if options.broker_restart and broker is not None:
            events.append((0.25, "broker Redis SIGKILLed and restarted", lambda: restart_redis(broker)))
        if options.db_restart and database is not None:
            events.append((0.5, "PostgreSQL restarted", database.restart))
        if options.store_cut:
            events.append((0.7, f"store cut for {options.store_cut:g}s", cut_store))
        chaos = Chaos(options=options, supervisor=supervisor, progress=counter.progress, events=events)
        chaos.start()
        publish(soak_app.job, messages, kinds)
        # A message a killed worker held comes back after the visibility timeout: wait well past it.
        quiet = max(60.0, 3 * options.visibility_timeout)
        counter.wait_settled(timeout=options.settle_timeout, label="jobs", quiet=quiet)
        chaos.stopping.set()
        chaos.join(60)
        counter.wait_drained(timeout=options.settle_timeout)
        before = counter.effects()
        # The fix is deployed; the permanent failures are replayed (the operator's gesture).
        (workdir / "fixed").touch()
        from django_celery_guardrails.models import DeadLetter
        from django_celery_guardrails.replay import replay_dead_letters

        permanent = DeadLetter.objects.filter(reason="permanent", status=DeadLetter.Status.OPEN)
        replay = replay_dead_letters(permanent, app=soak_app.app)
        result.replayed = len(getattr(replay, "replayed", []) or [])
        counter.replaying = {job for job, kind in kinds.items() if kind == "permanent"}
        reconciled: set[str] = set()
        if options.store != "django":
            # Ended after their marked effect, which may have acted: their owner looks, and replays the ones
            # whose effect is not there (allow_not_idempotent: the documented gesture for this reason).
            ambiguous = DeadLetter.objects.filter(reason=AMBIGUOUS, status=DeadLetter.Status.OPEN)
            jobs_of = {
                pk: args[0] for pk, args in ambiguous.values_list("pk", "args") if isinstance(args, list) and args
            }
            unmade = [pk for pk, job in jobs_of.items() if not before[job]]
            if unmade:
                replay = replay_dead_letters(unmade, app=soak_app.app, allow_not_idempotent=True)
                result.replayed += len(getattr(replay, "replayed", []) or [])
            reconciled = {jobs_of[pk] for pk in unmade}
            result.ambiguous, result.ambiguous_replayed = len(jobs_of), len(unmade)
            counter.replaying |= reconciled
        counter.wait_settled(timeout=options.settle_timeout, label="replayed jobs", quiet=quiet)
        counter.wait_drained(timeout=options.settle_timeout)
        supervisor.stop()
        stack.remove(supervisor)
        result.seconds = time.monotonic() - start
        after = counter.effects()
        tally(result, kinds, collections.Counter(messages), before, after, counter.dead_letters(), reconciled)
        claimed = claimed_keys(store_redis_url)
        result.claimed_keys, result.claimed_jobs = len(claimed), [job_of_key(key) for key in claimed[:100]]
        count_runs(result, workdir / "runs.log")
        result.killed = supervisor.kills
        result.deaths = supervisor.deaths
        result.events = chaos.log
        # A key left claimed is traced like a lost job: its delivery may have died with its message (its effect
        # done by an earlier delivery, the job is not lost, but no copy is left to take the key over).
        lost = [job for row in result.per_kind.values() for job in row["lost_jobs"]]
        traced = sorted({*lost, *result.claimed_jobs})
        if traced and broker is not None:
            from soak.trace import lost_causes

            result.lost_causes = lost_causes(broker.workdir, traced)
        judge(result, kombu_pop=options.kombu_pop)
        (workdir / f"result-{options.store}-{options.broker}.json").write_text(json.dumps(asdict(result), indent=1))
        return result
    finally:
        for item in reversed(stack):
            for verb in ("stop", "kill", "close"):
                if hasattr(item, verb):
                    getattr(item, verb)()
                    break
        if options.broker == "rabbitmq":
            _delete_rabbit_queue(queue)
            # Its exchange (Celery's default one is named after the queue); the delay exchanges are Celery's, shared.
            _delete_rabbit_exchange(queue)


def restart_redis(server: Any, *, down_for: float = 2.0) -> None:
    server.kill()
    time.sleep(down_for)
    server.start()


def publish(task: Any, messages: list[str], kinds: dict[str, str]) -> None:
    """Publish every message, trying again while the broker is away (a publish whose answer was lost may
    reach the broker twice: one more duplicate, which the key absorbs)."""
    for job in messages:
        while True:
            try:
                task.apply_async((job, kinds[job]))
                break
            except Exception as exc:  # the broker restarting: kombu's own retries are short
                print(f"  publish of {job} failed ({type(exc).__name__}); again in 1s", flush=True)
                time.sleep(1)


class Counter:
    """Reads the effects and dead letters (on the database directly, never through the cut) and the broker."""

    def __init__(self, kinds: dict[str, str], *, broker: str, queue: str, drain_interval: float = 2.0) -> None:
        self.kinds, self.broker, self.queue, self.drain_interval = kinds, broker, queue, drain_interval
        self.replaying: set[str] = set()
        self.expect_effect = {job for job, kind in kinds.items() if kind in EFFECT_KINDS and kind != "permanent"}
        self.expect_dead = {job for job, kind in kinds.items() if kind in EXPECTED_REASON}

    def _query(self, sql: str) -> list[tuple[Any, ...]]:
        from django.db import connection

        for _ in range(60):  # the database is restarted once during the soak
            try:
                with connection.cursor() as cursor:
                    cursor.execute(sql)
                    return list(cursor.fetchall())
            except Exception:
                connection.close()
                time.sleep(1)
        raise RuntimeError(f"the soak's database does not answer: {sql}")

    def effects(self) -> collections.Counter[str]:
        return collections.Counter(dict(self._query("SELECT job, count(*) FROM soak_effect GROUP BY job")))

    def dead_letters(self) -> list[tuple[str, str]]:
        """(job, reason) of every dead letter."""
        rows = self._query("SELECT args::text, reason FROM guardrails_deadletter")
        return [(json.loads(args)[0] if args and args != "null" else "?", reason) for args, reason in rows]

    def settled(self) -> int:
        effects = self.effects()
        letters = self.dead_letters()
        dead = {job for job, _ in letters}
        # A job ended after its marked effect (not_idempotent) has settled too: its end is recorded (the replay
        # then waits for its effect, if it is one replayed).
        ambiguous = {job for job, reason in letters if reason == AMBIGUOUS} - self.replaying
        wanted = self.expect_effect | self.replaying
        return sum(1 for job in wanted if effects[job] or job in ambiguous) + len(
            (self.expect_dead - self.replaying) & dead
        )

    def progress(self) -> float:
        total = len(self.expect_effect) + len(self.expect_dead)
        return self.settled() / total

    def wait_settled(self, *, timeout: float, label: str, quiet: float) -> None:
        """Until every job has its effect (or, for a failing kind, its dead letter); or, once nothing has
        settled for ``quiet`` seconds and the broker holds nothing for the queue, the rest are lost."""
        total = len(self.expect_effect | self.replaying) + len(self.expect_dead - self.replaying)
        deadline, last = time.monotonic() + timeout, -1
        moved, before = time.monotonic(), -1
        while (done := self.settled()) < total:
            if done != before:
                moved, before = time.monotonic(), done
            stalled = time.monotonic() - moved > quiet and self.pending() == 0
            if stalled or time.monotonic() > deadline:
                why = f"nothing moved for {quiet:g}s and the broker holds nothing" if stalled else f"{timeout:g}s"
                print(f"  {label}: {total - done} of {total} never settled ({why})", flush=True)
                return
            if done // max(1, total // 10) != last:
                last = done // max(1, total // 10)
                print(f"  {time.strftime('%H:%M:%S')} {label}: {done}/{total} settled", flush=True)
            time.sleep(1)
        print(f"  {time.strftime('%H:%M:%S')} {label}: {total}/{total} settled", flush=True)

    def pending(self) -> int:
        """Messages the broker still holds for the soak's queue, handed out or not."""
        if self.broker == "redis":
            import redis

            client = redis.Redis.from_url(os.environ["SOAK_BROKER_URL"])
            for _ in range(60):
                try:
                    # kombu's Redis transport: the queue is a list, handed-out messages sit in "unacked".
                    return int(client.llen(self.queue)) + int(client.hlen("unacked"))
                except redis.RedisError:
                    time.sleep(1)
            raise RuntimeError("the soak's broker does not answer")
        out = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "name", "messages"], capture_output=True, text=True, check=True
        ).stdout
        for line in out.splitlines():
            name, _, count = line.partition("\t")
            if name == self.queue:
                return int(count)
        return 0

    def wait_drained(self, *, timeout: float) -> None:
        """Until the broker holds nothing for the queue three checks running (a redelivered copy would show)."""
        deadline, quiet = time.monotonic() + timeout, 0
        while quiet < 3 and time.monotonic() < deadline:
            quiet = quiet + 1 if self.pending() == 0 else 0
            time.sleep(self.drain_interval)


def tally(
    result: Result,
    kinds: dict[str, str],
    copies: collections.Counter[str],
    before: collections.Counter[str],
    after: collections.Counter[str],
    dead: list[tuple[str, str]],
    reconciled: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Per kind: lost, doubled, dead letters and their reasons. ``reconciled``: the jobs ended ``not_idempotent``
    without their effect, replayed (Redis store): judged after the replay, like the permanent ones."""
    # On the Redis store an effect kind may end not_idempotent (see the module docstring): not misfiled there.
    allowed = {AMBIGUOUS} if result.store != "django" else set()
    reasons: dict[str, collections.Counter[str]] = {kind: collections.Counter() for kind in KINDS}
    dead_per_job: collections.Counter[str] = collections.Counter()
    for job, reason in dead:
        reasons[kinds.get(job, "ok")][reason] += 1
        dead_per_job[job] += 1
    for kind in KINDS:
        jobs = [job for job, k in kinds.items() if k == kind]
        wants_effect = kind in EFFECT_KINDS

        def final(job: str, kind: str = kind) -> int:
            return after[job] if kind == "permanent" or job in reconciled else before[job]

        row = {
            "jobs": len(jobs),
            "lost": sum(1 for job in jobs if wants_effect and final(job) == 0),
            "doubled": sum(1 for job in jobs if final(job) > 1),
            "dead_expected": len(jobs) if kind in EXPECTED_REASON else 0,
            # at most one per message: both copies of a poison job published twice may die as poison
            "dead_most": sum(copies[job] for job in jobs)
            if kind == "poison"
            else (len(jobs) * (kind in EXPECTED_REASON)),
            "dead_found": sum(dead_per_job[job] for job in jobs),
            "misfiled": sum(
                count
                for reason, count in reasons[kind].items()
                if reason != EXPECTED_REASON.get(kind) and not (wants_effect and reason in allowed)
            )
            # one dead letter per failing job; two when both copies of a job published twice died as poison
            + sum(1 for job in jobs if kind in EXPECTED_REASON and not 1 <= dead_per_job[job] <= copies[job]),
            "effects_before_fix": sum(1 for job in jobs if before[job]) if kind in EXPECTED_REASON else None,
        }
        row["lost_jobs"] = [job for job in jobs if wants_effect and final(job) == 0][:10]
        result.per_kind[kind] = row
        result.reasons[kind] = dict(reasons[kind])
    result.replay_duplicates = sum(max(0, after[job] - 1) for job, kind in kinds.items() if kind == "permanent")
    # Anything else the replay's run added (a job of another kind run again; a reconciled one, once more than the
    # one effect it was replayed for).
    result.replay_duplicates += sum(
        after[job] - before[job] - (job in reconciled) for job, kind in kinds.items() if kind != "permanent"
    )


def count_runs(result: Result, log: Path) -> None:
    """The runs of the jobs' bodies (one line per run in ``log``): all told, and the most for one job."""
    runs = collections.Counter(log.read_text().split()) if log.exists() else collections.Counter()
    result.runs = sum(runs.values())
    if runs:
        result.most_runs_job, result.most_runs = runs.most_common(1)[0]


def job_of_key(key: str) -> str:
    """The job of a soak key (``[guardrails:idem:]soak.job:<tenant>:job:<job id>``)."""
    return key.rsplit("job:", 1)[-1]


def claimed_keys(redis_url: str | None) -> list[str]:
    """Idempotency keys still claimed once everything settled (a claim nobody will complete). The guardrails'
    own claims (``guardrails:``: the watchdog's turn, the activity's queue sampling) are leases that lapse on
    their own, never completed: they are not jobs' keys."""
    from celery_guardrails.stores.base import INTERNAL_KEY_PREFIX

    if redis_url is None:
        from django_celery_guardrails.models import IdempotencyKey

        rows = IdempotencyKey.objects.filter(state="claimed").exclude(key__startswith=INTERNAL_KEY_PREFIX)
        for row in rows[:5]:
            print(f"  left claimed: {row.key} by {row.owner}, lease until {row.lease_until}", flush=True)
        return list(rows.values_list("key", flat=True))
    import redis

    from celery_guardrails.stores.redis import IDEM_PREFIX

    client = redis.Redis.from_url(redis_url)
    internal = f"{IDEM_PREFIX}{INTERNAL_KEY_PREFIX}".encode()
    claimed = [
        key
        for key in client.scan_iter(f"{IDEM_PREFIX}*")
        if not key.startswith(internal) and client.hget(key, "state") == b"claimed"
    ]
    for key in claimed[:5]:
        print(f"  left claimed: {key.decode()} {client.hgetall(key)}", flush=True)
    return [key.decode() for key in claimed]


def judge(result: Result, *, kombu_pop: bool) -> None:
    """The failures: any loss (but, with ``kombu_pop``, where the workers pop with kombu's BRPOP on purpose,
    one traced to its pop window is listed, not failed), a doubled effect with the Django store or from the
    replay, a misfiled dead letter, a key left claimed."""
    from soak.trace import KOMBU_POP_WINDOW

    for kind, row in result.per_kind.items():
        ours = [job for job in row["lost_jobs"] if not kombu_pop or result.lost_causes.get(job) != KOMBU_POP_WINDOW]
        if row["lost"] > len(row["lost_jobs"]) or ours:  # (only the first ten are named)
            result.failures.append(f"{row['lost']} {kind} job(s) lost")
        if row["doubled"] and (result.store == "django" or kind == "permanent"):
            result.failures.append(f"{row['doubled']} {kind} job(s) with a doubled effect")
        if row["misfiled"]:
            result.failures.append(f"{row['misfiled']} {kind} dead letter(s) misfiled: {result.reasons[kind]}")
    # With kombu's pop, a key left claimed by a delivery whose message kombu lost (traced as above) is listed.
    ours = [job for job in result.claimed_jobs if not kombu_pop or result.lost_causes.get(job) != KOMBU_POP_WINDOW]
    if result.claimed_keys > len(result.claimed_jobs) or ours:
        result.failures.append(f"{result.claimed_keys} key(s) left claimed")
    if result.replay_duplicates:
        result.failures.append(f"the replay added {result.replay_duplicates} duplicate effect(s)")
    if result.most_runs > LOOP_LIMIT:
        result.failures.append(f"job {result.most_runs_job} ran {result.most_runs} times (a loop)")


def expected(row: dict[str, Any]) -> str:
    low, high = row["dead_expected"], row.get("dead_most", row["dead_expected"])
    return str(low) if low == high else f"{low}-{high}"


def render(results: list[Result]) -> str:
    lines = []
    for result in results:
        queue = f" ({result.queue_type} queue, {result.exchange} exchange)" if result.queue_type == "quorum" else ""
        lines.append(
            f"\n{result.store} store, {result.broker} broker{queue}: {result.jobs} jobs ({result.messages} messages) "
            f"in "
            f"{result.seconds:.0f}s; {result.killed} workers SIGKILLed; {len(result.deaths)} died on their own"
        )
        lines.append(
            f"{'kind':<10} {'jobs':>6} {'lost':>5} {'doubled':>8} {'dead letters (found/expected)':>30}  reasons"
        )
        for kind, row in result.per_kind.items():
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(result.reasons[kind].items())) or "-"
            lines.append(
                f"{kind:<10} {row['jobs']:>6} {row['lost']:>5} {row['doubled']:>8} "
                f"{row['dead_found']:>14}/{expected(row):<15}  {reasons}"
            )
        lost = [job for row in result.per_kind.values() for job in row.get("lost_jobs", [])]
        for job in lost:
            lines.append(f"lost: {job}: {result.lost_causes.get(job, 'no trace read (RabbitMQ)')}")
        for job in result.claimed_jobs:
            lines.append(f"left claimed: {job}: {result.lost_causes.get(job, 'no trace read (RabbitMQ)')}")
        if result.ambiguous:
            lines.append(
                f"ended not_idempotent after their marked effect: {result.ambiguous} "
                f"({result.ambiguous_replayed} without their effect, replayed with allow_not_idempotent)"
            )
        lines.append(
            f"keys left claimed: {result.claimed_keys}; replayed {result.replayed}, "
            f"duplicates the replay added: {result.replay_duplicates}; "
            f"runs {result.runs}, most for one job {result.most_runs} ({result.most_runs_job or '-'})"
        )
        causes = collections.Counter(death.cause for death in result.deaths)
        for cause, count in causes.most_common():
            lines.append(f"worker deaths of their own: {count} x {cause}")
        lines.append("events: " + "; ".join(line.split(" ", 1)[1] for line in result.events if ": over" not in line))
        lines.append("PASS" if not result.failures else "FAIL: " + "; ".join(result.failures))
    return "\n".join(lines)


def _psql(port: int, database: str, sql: str) -> None:
    subprocess.run(
        [
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-U",
            "postgres",
            "-d",
            database,
            "-v",
            "ON_ERROR_STOP=1",
            "-q",
            "-c",
            sql,
        ],
        check=True,
        capture_output=True,
    )


class SharedDatabase:
    """A database of the soak's own on the machine's PostgreSQL (``--short``), dropped at the end."""

    def __init__(self, name: str) -> None:
        self.name = name

    def stop(self) -> None:
        from django.db import connections

        connections.close_all()
        _psql(5432, "postgres", f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _delete_rabbit_queue(queue: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", "delete_queue", queue], capture_output=True, check=False)


def _delete_rabbit_exchange(name: str) -> None:
    import contextlib

    from kombu import Connection

    with (
        Connection("amqp://guest:guest@127.0.0.1:5672//") as connection,
        contextlib.suppress(*connection.channel_errors, *connection.connection_errors),
    ):
        connection.default_channel.exchange_delete(name)


def parse(argv: list[str]) -> tuple[Options, list[str], list[str], list[str], bool]:
    parser = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("SOAK_JOBS", "10000")))
    parser.add_argument(
        "--store",
        choices=["django", "redis", "broker", "both"],
        default="both",
        help="broker: the Redis store on the broker's own database (the ack on the store, the claim with the pop "
        "where the pool runs tasks in the consuming process: --pool threads)",
    )
    parser.add_argument("--pool", choices=["prefork", "threads"], default="prefork", help="the workers' pool (-c 2)")
    parser.add_argument("--broker", choices=["redis", "rabbitmq", "both"], default="redis")
    parser.add_argument(
        "--queue-type",
        choices=["classic", "quorum"],
        default="classic",
        help="RabbitMQ: quorum runs on a quorum queue (the Redis broker is left out)",
    )
    parser.add_argument(
        "--exchange",
        choices=["topic", "direct", "both"],
        default="topic",
        help="--queue-type quorum: the queue's exchange (topic: native delayed delivery; direct: the worker holds "
        "the ETAs)",
    )
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between two SIGKILLs")
    parser.add_argument("--store-cut", type=float, default=10.0, help="seconds the store is cut (0: never)")
    parser.add_argument("--short", action="store_true", help="the suite's soak: one kill, one store cut")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--kombu-pop",
        action="store_true",
        help="workers pop with kombu's BRPOP (broker_atomic_pop off): a loss in its pop window (celery/kombu#305) "
        "is listed, not failed",
    )
    parser.add_argument("--workdir", default="")
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args(argv)
    options = Options(
        jobs=args.jobs,
        kill_every=args.kill_every,
        store_cut=args.store_cut,
        seed=args.seed,
        workdir=args.workdir,
        kombu_pop=args.kombu_pop,
        queue_type=args.queue_type,
        pool=args.pool,
    )
    if args.short:
        options.kills, options.broker_restart, options.db_restart = 1, False, False
        options.private_db, options.visibility_timeout, options.settle_timeout = False, 10.0, 240.0
        options.drain_interval = 1.0
    stores = ["django", "redis"] if args.store == "both" else [args.store]
    brokers = ["redis", "rabbitmq"] if args.broker == "both" else [args.broker]
    if args.queue_type == "quorum":  # a RabbitMQ queue type
        brokers = ["rabbitmq"]
    exchanges = ["topic", "direct"] if args.exchange == "both" else [args.exchange]
    return options, stores, brokers, exchanges, args.json


def _interrupted(signum: int, frame: Any) -> None:
    raise SystemExit(f"soak: stopped by signal {signum}")  # the finally blocks stop what the soak started


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    if argv[:1] == ["--variant"]:  # one store and broker in a process of its own (Django is set up once)
        options = Options(**json.loads(argv[1]))
        result = run_variant(options)
        print("RESULT " + json.dumps(asdict(result)), flush=True)
        return 0
    options, stores, brokers, exchanges, as_json = parse(argv)
    results = []
    for broker, exchange, store in [(b, e, s) for b in brokers for e in exchanges for s in stores]:
        variant = asdict(options) | {"store": store, "broker": broker, "exchange": exchange}
        if broker == "rabbitmq":
            variant["broker_restart"] = False
        child = subprocess.Popen(
            [sys.executable, "-m", "soak.run", "--variant", json.dumps(variant)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert child.stdout is not None
        found = []
        try:
            for line in child.stdout:  # progress as it comes; the result line kept
                if line.startswith("RESULT "):
                    found.append(line)
                else:
                    print(line, end="", flush=True)
        finally:
            if child.poll() is None and not found:  # this process was stopped: so is the variant
                child.terminate()
        if child.wait() or not found:
            print(f"soak [{store} store, {broker} broker] did not finish (exit {child.returncode})")
            return 2
        data = json.loads(found[-1][len("RESULT ") :])
        data["deaths"] = [Death(**death) for death in data["deaths"]]
        results.append(Result(**data))
    print(json.dumps([asdict(r) for r in results], indent=1) if as_json else render(results))
    return 1 if any(result.failures for result in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
