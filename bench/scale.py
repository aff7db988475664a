"""``bench/scale.py``: the Django app at scale on PostgreSQL (issue #13), timed from outside, goals beside.

Creates a private database ``guardrails_scale_<random>`` on the PostgreSQL server (dropped at the end, also on
Ctrl-C), migrates the example project into it (``example_project.settings``, its database pointed there), and
bulk-loads SCALE_ROWS realistic dead letters (default 1,000,000; ``INSERT ... SELECT generate_series``: a
dozen tasks, 500 tenants, eight owners, every reason, 8 % open, attempt histories, tracebacks, times over 180
days; the charge records with a sealed copy), SCALE_SCHEDULES guarded django-celery-beat schedules (default
10,000) with SCALE_RUNS ledger records each (default 50), then times, SCALE_ROUNDS times each (default 5):

* the dead-letter change list through Django's test Client, logged in as a superuser (the real admin view,
  templates and all): the first page, filtered pages, a search by correlation id and by task id;
* a replay of SCALE_REPLAY open dead letters (default 10,000): ``replay_dead_letters``, the
  ``guardrails_replay`` command, the admin action and the bulk job's body (the records reopened before each;
  published to a private Redis started for the run), each right after plain Celery publishing as many (the
  floor its ratio is taken against), in an order that turns with the round (SCALE_REPLAY_ROUNDS, default 3);
* one watchdog pass (``celery_guardrails.scheduling.watchdog.check``) and the schedule-health list over every schedule;
* ``guardrails_prune`` (rounds of older and older records), with the longest transaction it held, read from
  ``pg_stat_activity`` by a second connection every 10 ms (a row lock is held until the end of its
  transaction, so that is the longest a concurrent writer could have waited).

Prints a table: median, range, goal. Asserts nothing. Needs PostgreSQL (SCALE_PGHOST/SCALE_PGPORT/SCALE_PGUSER,
default 127.0.0.1:5432 postgres, trust auth) and ``redis-server`` on the PATH. Run: ``.venv/bin/python
bench/scale.py``; a small run: ``SCALE_ROWS=20000 SCALE_REPLAY=500 SCALE_SCHEDULES=200 .venv/bin/python
bench/scale.py``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
ROWS = int(os.environ.get("SCALE_ROWS", "1000000"))
REPLAY = int(os.environ.get("SCALE_REPLAY", "10000"))
SCHEDULES = int(os.environ.get("SCALE_SCHEDULES", "10000"))
RUNS = int(os.environ.get("SCALE_RUNS", "50"))
ROUNDS = int(os.environ.get("SCALE_ROUNDS", "5"))
PG = {
    "host": os.environ.get("SCALE_PGHOST", "127.0.0.1"),
    "port": int(os.environ.get("SCALE_PGPORT", "5432")),
    "user": os.environ.get("SCALE_PGUSER", "postgres"),
}
#: The replay set's reason: a provider outage leaves many circuit_open records, replayed at once after it.
REPLAY_REASON = "circuit_open"
#: A replay's time over plain Celery publishing as many messages in the same round, at most (#33).
REPLAY_RATIO_GOAL = 1.2
CHARGE = "example_project.shop.tasks.charge_order"
RECEIPT = "example_project.shop.tasks.send_receipt"
SETTLE = "example_project.shop.tasks.settle_payments"
OTHER_TASKS = [
    "shop.tasks.sync_inventory",
    "shop.tasks.refund_order",
    "shop.tasks.export_ledger",
    "mail.tasks.send_newsletter",
    "search.tasks.reindex_product",
    "billing.tasks.issue_invoice",
    "billing.tasks.dunning_reminder",
    "data.tasks.nightly_rollup",
    "ops.tasks.rotate_keys",
    "crm.tasks.push_contact",
]
OWNERS = ["payments", "ops", "search", "mail", "inventory", "billing", "data", ""]
REASONS = [
    "permanent",
    "not_idempotent",
    "attempts_exhausted",
    "retry_later_exhausted",
    "retry_budget_exhausted",
    "circuit_open",
    "missing_tenant",
    "bad_idempotency_key",
    "poison",
    "store_refused",
    "malformed_message",
    "time_limit",
]
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/.venv/lib/python3.11/site-packages/celery/app/trace.py", line 453, in trace_task\n'
    "    R = retval = fun(*args, **kwargs)\n"
    '  File "/srv/app/.venv/lib/python3.11/site-packages/celery_guardrails/task.py", line 212, in __call__\n'
    "    return self.pipeline.run(self, args, kwargs)\n"
    '  File "/srv/app/shop/payments.py", line 88, in charge\n'
    "    response = session.post(url, json=payload, timeout=(3.05, 10))\n"
    '  File "/srv/app/.venv/lib/python3.11/site-packages/requests/sessions.py", line 637, in post\n'
    "    return self.request('POST', url, data=data, json=json, **kwargs)\n"
)


@dataclass
class Figure:
    """One operation: seconds per round, its goal, and what else was seen."""

    name: str
    goal: float | None  # seconds; None: shown for information
    seconds: list[float] = field(default_factory=list)
    note: str = ""

    def line(self) -> str:
        goal = "" if self.goal is None else "< " + seconds(self.goal)
        if not self.seconds:
            return f"{self.name:<58} {'-':>9}  {'':<19} {goal:>10}  not run {self.note}"
        median = statistics.median(self.seconds)
        spread = f"{seconds(min(self.seconds))}-{seconds(max(self.seconds))}"
        verdict = "" if self.goal is None else "ok" if max(self.seconds) < self.goal else "OVER"
        return f"{self.name:<58} {seconds(median):>9}  {spread:<19} {goal:>10}  {verdict:<4} {self.note}".rstrip()


def seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A Redis server of this run only (the replays publish to it), stopped and removed at the end."""
    folder = tempfile.mkdtemp(prefix="guardrails-scale-redis-")
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(
        [*command, "--dir", folder],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def private_database() -> Iterator[str]:
    """A database of this run only on the shared server, dropped at the end (its connections ended first)."""
    name = f"guardrails_scale_{secrets.token_hex(4)}"
    with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:  # type: ignore[arg-type]
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with psycopg.connect(dbname="postgres", autocommit=True, **PG) as admin:  # type: ignore[arg-type]
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        print(f"Dropped database {name}.")


def set_up_django(database: str, broker: str) -> None:
    """The example project's settings, with its database pointed at ``database`` and its broker at ``broker``."""
    from cryptography.fernet import Fernet

    os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
    os.environ.setdefault("GUARDRAILS_SEAL_KEY", Fernet.generate_key().decode())  # no key file written
    os.environ["EXAMPLE_BROKER_URL"] = broker
    os.environ["EXAMPLE_RESULT_BACKEND"] = broker
    os.environ["EXAMPLE_QUEUE"] = "scale"
    os.environ.setdefault("EXAMPLE_LOG_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings

    # Before anything opens a connection: the example project's settings choose SQLite, this run PostgreSQL.
    settings.DATABASES = {
        "default": {"ENGINE": "django.db.backends.postgresql", "NAME": database, "CONN_MAX_AGE": None}
        | {"HOST": PG["host"], "PORT": str(PG["port"]), "USER": PG["user"]}
    }
    settings.DEBUG = False  # as in production: no query log kept in memory
    django.setup()
    from example_project.celery_app import app
    from example_project.shop import tasks  # noqa: F401  (the tasks replays publish)

    app.set_current()
    app.set_default()


def execute(sql: str, params: Any = None) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def scalar(sql: str, params: Any = None) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else row[0]


def load_dead_letters() -> None:
    """SCALE_ROWS records in one INSERT ... SELECT; then exactly SCALE_REPLAY open circuit_open records of the
    example project's two tasks (the replay set), and sealed copies of the charges."""
    started = time.perf_counter()
    tasks = [CHARGE, RECEIPT, *OTHER_TASKS]
    execute("SELECT setseed(0.13)")
    execute(
        """
        INSERT INTO guardrails_deadletter (
            task_name, task_id, queue, routing_key, args, kwargs, arguments_are_repr, tenant, correlation_id,
            idempotency_key, header, reason, exc_type, exc_message, traceback, history, attempts,
            first_failed_at, last_failed_at, owner, status, replayed_task_id, handled_by, handled_at, created_at)
        SELECT task, tid, 'celery', 'celery',
               CASE WHEN task = %(charge)s THEN jsonb_build_array(i, 1000 + i %% 9000)
                    ELSE jsonb_build_array(i) END,
               CASE WHEN task = %(charge)s THEN jsonb_build_object('card_token', '[redacted]')
                    ELSE '{}'::jsonb END,
               false, tenant, cid,
               CASE WHEN task = %(charge)s THEN task || ':' || tenant || ':charge:' || i ELSE '' END,
               -- the header a GuardedTask's publish gives every message (its payload version, when it went
               -- out; a keyed task's key), as the worker records it with the failure
               jsonb_build_object('v', 1, 'tenant', tenant, 'cid', cid, 'attempt', attempts, 'pv', 1,
                                  'pub', extract(epoch FROM last - attempts * interval '30 seconds'))
               || CASE WHEN task = %(charge)s THEN jsonb_build_object('idem', 'charge:' || i) ELSE '{}'::jsonb END,
               reason, 'requests.exceptions.ConnectionError',
               'HTTPSConnectionPool(host=''api.example.com'', port=443): Max retries exceeded with url: /v1/x/' || i,
               %(traceback)s || '    raise ConnectionError(e, request=request) (record ' || i || ')',
               (SELECT jsonb_agg(jsonb_build_object(
                    'n', n, 'start', to_char(last - (attempts - n) * interval '30 seconds', 'YYYY-MM-DD"T"HH24:MI:SS'),
                    'end', to_char(last - (attempts - n) * interval '30 seconds' + interval '2 seconds',
                                   'YYYY-MM-DD"T"HH24:MI:SS'),
                    'host', 'celery@worker-' || (i %% 7), 'class', 'transient', 'rule', 'backoff',
                    'exc', 'ConnectionError', 'delay', 2 ^ n))
                FROM generate_series(1, attempts) AS n),
               attempts, last - attempts * interval '30 seconds', last,
               (%(owners)s::text[])[1 + (i * 7) %% 8], status,
               CASE WHEN status = 'replayed' THEN md5(i::text || 'replay')::uuid::text ELSE '' END,
               CASE WHEN status = 'open' THEN '' ELSE 'alice' END,
               CASE WHEN status = 'open' THEN NULL ELSE last + interval '3 hours' END,
               last
        FROM (
            SELECT i, md5(i::text || 'task')::uuid::text AS tid, md5(i::text || 'cid')::uuid::text AS cid,
                   (%(tasks)s::text[])[1 + (i * 11) %% %(task_count)s] AS task,
                   'tenant-' || (i * 13) %% 500 AS tenant,
                   (%(reasons)s::text[])[1 + (i * 17) %% 12] AS reason,
                   1 + (i %% 5) AS attempts,
                   now() - random() * interval '180 days' AS last,
                   CASE WHEN r < 0.08 THEN 'open' WHEN r < 0.20 THEN 'replayed'
                        WHEN r < 0.40 THEN 'discarded' ELSE 'resolved' END AS status
            FROM (SELECT i, random() AS r FROM generate_series(1, %(rows)s) AS i) AS numbers
        ) AS rows
        """,
        {
            "rows": ROWS,
            "charge": CHARGE,
            "tasks": tasks,
            "task_count": len(tasks),
            "owners": OWNERS,
            "reasons": REASONS,
            "traceback": TRACEBACK,
        },
    )
    # The replay set: no other record is open with its reason; then SCALE_REPLAY open ones of the two tasks.
    execute(
        "UPDATE guardrails_deadletter SET reason = 'permanent' WHERE status = 'open' AND reason = %s", [REPLAY_REASON]
    )
    execute(
        """
        UPDATE guardrails_deadletter SET status = 'open', reason = %s, replayed_task_id = '', handled_by = '',
               handled_at = NULL
        WHERE id IN (SELECT id FROM guardrails_deadletter WHERE task_name IN (%s, %s) ORDER BY id DESC LIMIT %s)
        """,
        [REPLAY_REASON, CHARGE, RECEIPT, REPLAY],
    )
    seal_charges()
    fingerprint_by_task()
    print(f"Loaded {ROWS:,} dead letters in {time.perf_counter() - started:.0f} s.", flush=True)


def fingerprint_by_task() -> None:
    """Each record's fingerprint, as the worker makes it: the loaded records of a task and reason differ only in
    the numbers of their message and traceback, so one record of each says it for all of them."""
    from celery_guardrails.foundation.fingerprints import fingerprint

    rows = scalar_rows(
        "SELECT DISTINCT ON (task_name, reason) task_name, reason, exc_type, exc_message, traceback "
        "FROM guardrails_deadletter ORDER BY task_name, reason"
    )
    for task_name, reason, exc_type, exc_message, traceback in rows:
        cause = fingerprint(task_name=task_name, exc_type=exc_type, exc_message=exc_message, traceback=traceback)
        execute(
            "UPDATE guardrails_deadletter SET fingerprint = %s WHERE task_name = %s AND reason = %s",
            [cause, task_name, reason],
        )


def seal_charges() -> None:
    """Each charge record's sealed copy (its real card token), written with COPY."""
    from django.db import connection

    from celery_guardrails.foundation.sealing import Binding, sealer_for

    sealer = sealer_for(current_app())
    assert sealer is not None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, args, header, task_id, task_name, tenant FROM guardrails_deadletter WHERE task_name = %s",
            [CHARGE],
        )
        rows = cursor.fetchall()
        now = datetime.now(UTC)
        with cursor.copy("COPY guardrails_sealedmessage (dead_letter_id, token, sealed_at) FROM STDIN") as copy:
            for pk, args, header, task_id, task_name, tenant in rows:
                args = args if isinstance(args, list) else __import__("json").loads(args)
                header = header if isinstance(header, dict) else __import__("json").loads(header)
                # Bound to its record, as a worker seals a failure's copy (a replay opens it only for that record).
                record = Binding(task_id=task_id, task_name=task_name, tenant=tenant or "")
                token = sealer.seal(args=args, kwargs={"card_token": f"tok_{pk:08d}"}, header=header, record=record)
                copy.write_row((pk, token, now))


def load_schedules(now: float) -> dict[str, dict[str, Any]]:
    """SCALE_SCHEDULES django-celery-beat rows (hourly intervals and crontabs), SCALE_RUNS ledger records each,
    up to the current period; one in twenty running now. Returns their policies."""
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    started = time.perf_counter()
    hourly = IntervalSchedule.objects.create(every=3600, period=IntervalSchedule.SECONDS)
    crontab = CrontabSchedule.objects.create(minute="0", hour="*", timezone="UTC")
    PeriodicTask.objects.bulk_create(
        PeriodicTask(
            name=f"scale-{n:05d}",
            task=SETTLE,
            interval=hourly if n % 2 else None,
            crontab=None if n % 2 else crontab,
            headers=f'{{"tenant": "tenant-{n % 500}"}}',
        )
        for n in range(SCHEDULES)
    )
    current_period = int(now // 3600 * 3600)
    execute(
        """
        INSERT INTO guardrails_scheduledrun (schedule, period, status, task_id, dispatched_at, started_at,
                                             finished_at, reason, updated_at)
        SELECT name, to_timestamp(%(current)s - k * 3600),
               CASE WHEN k = 0 AND n %% 20 = 0 THEN 'running' ELSE 'ok' END,
               md5(name || k)::uuid::text,
               to_timestamp(%(current)s - k * 3600), to_timestamp(%(current)s - k * 3600 + 1),
               CASE WHEN k = 0 AND n %% 20 = 0 THEN NULL ELSE to_timestamp(%(current)s - k * 3600 + 30) END,
               '', now()
        FROM (SELECT 'scale-' || lpad(n::text, 5, '0') AS name, n FROM generate_series(0, %(count)s - 1) AS n) s,
             generate_series(0, %(runs)s - 1) AS k
        """,
        {"current": current_period, "count": SCHEDULES, "runs": RUNS},
    )
    print(
        f"Loaded {SCHEDULES:,} schedules, {SCHEDULES * RUNS:,} ledger records in "
        f"{time.perf_counter() - started:.0f} s.",
        flush=True,
    )
    policy = {"grace": 600, "max_runtime": 3 * 3600, "owner": "ops", "timezone": "UTC"}
    return {f"scale-{n:05d}": dict(policy) for n in range(SCHEDULES)}


def current_app() -> Any:
    from example_project.celery_app import app

    return app


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def bench_change_list(figures: list[Figure]) -> None:
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    user = User.objects.create_superuser(f"scale-{uuid.uuid4().hex[:6]}", "scale@example.com", "pw")
    client = Client()
    client.force_login(user)
    url = reverse("admin:guardrails_deadletter_changelist")
    picks = list(
        scalar_rows(
            "SELECT task_id, correlation_id FROM guardrails_deadletter TABLESAMPLE SYSTEM (1) LIMIT %s", [ROUNDS]
        )
    )
    cause = scalar("SELECT fingerprint FROM guardrails_deadletter WHERE status = 'open' LIMIT 1")
    orders = [
        row[0]
        for row in scalar_rows(
            "SELECT (args->>0)::bigint FROM guardrails_deadletter TABLESAMPLE SYSTEM (1) WHERE task_name = %s LIMIT %s",
            [CHARGE, ROUNDS],
        )
    ]
    pages: list[tuple[str, dict[str, str] | Callable[[int], dict[str, str]]]] = [
        ("change list: first page", {}),
        ("change list: status=open", {"status__exact": "open"}),
        ("change list: owner=payments", {"owner__exact": "payments"}),
        ("change list: reason=poison, status=open", {"reason__exact": "poison", "status__exact": "open"}),
        ("change list: tenant=tenant-7, status=resolved", {"tenant__exact": "tenant-7", "status__exact": "resolved"}),
        ("change list: search by correlation id", lambda r: {"q": picks[r % len(picks)][1]}),
        ("change list: search by task id", lambda r: {"q": picks[r % len(picks)][0]}),
        # #34: a cause's records, an argument (the charge's first, positional)
        ("change list: one cause, status=open", {"fingerprint": cause, "status__exact": "open"}),
        ("change list: search by argument order_id=N", lambda r: {"q": f"order_id={orders[r % len(orders)]}"}),
    ]
    #: #34's pages: 100 ms, every round
    quick = {"change list: status=open", "change list: one cause, status=open"}
    client.get(url)  # one warm-up request (templates loaded, connection open): not timed
    for name, query in pages:
        figure = Figure(name, 0.1 if name in quick or "argument" in name else 0.3)
        for round_ in range(ROUNDS):
            params = query(round_) if callable(query) else query
            elapsed, page = timed(lambda params=params: client.get(url, params))
            if page.status_code != 200:
                figure.note = f"status {page.status_code}"
            elif "q" in params and "=" not in params["q"] and params["q"].encode() not in page.content:
                figure.note = "record not found!"
            elif "q" in params and "=" in params["q"] and b'class="dl-matched"' not in page.content:
                figure.note = "argument not found!"
            figure.seconds.append(elapsed)
        figures.append(figure)
        print(figure.line(), flush=True)
    overview = Figure("overview: open records by cause, reason, owner, task", None)
    for _ in range(ROUNDS):
        elapsed, page = timed(lambda: client.get(reverse("admin:guardrails_deadletter_overview")))
        overview.seconds.append(elapsed)
        causes = page.content.split(b'id="by-cause"')[-1].split(b"</table>")[0].count(b"<tr><td><a ")
        overview.note = f"{causes} causes listed" if page.status_code == 200 else f"status {page.status_code}"
    figures.append(overview)
    print(overview.line(), flush=True)


def scalar_rows(sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def reopen_replay_set(ids: list[int]) -> None:
    """The replay set open again, its failed idempotency keys back, the private broker's queue emptied."""
    from django.db import connection

    execute(
        "UPDATE guardrails_deadletter SET status = 'open', replayed_task_id = '', handled_by = '', handled_at = NULL"
        " WHERE id = ANY(%s)",
        [ids],
    )
    execute(
        """
        INSERT INTO guardrails_idempotencykey (key, state, owner, summary, reason, created_at, finished_at)
        SELECT idempotency_key, 'failed', 'celery@worker-1', '', 'circuit open', now(), now()
        FROM guardrails_deadletter WHERE id = ANY(%s) AND idempotency_key <> ''
        ON CONFLICT (key) DO NOTHING
        """,
        [ids],
    )
    execute("DELETE FROM django_admin_log")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE guardrails_deadletter")
    current_app().connection_for_write().default_channel.client.flushdb()


def bench_replay(figures: list[Figure]) -> None:
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse

    from django_celery_guardrails.replay import replay_dead_letters

    ids = [
        row[0]
        for row in scalar_rows(
            "SELECT id FROM guardrails_deadletter WHERE status = 'open' AND reason = %s", [REPLAY_REASON]
        )
    ]
    user = User.objects.filter(is_superuser=True).first()
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:guardrails_deadletter_changelist")
    rounds = max(1, int(os.environ.get("SCALE_REPLAY_ROUNDS", "3")))

    def function() -> int:
        return len(replay_dead_letters(ids, user=user).replayed)

    def command() -> int:
        out = StringIO()
        call_command("guardrails_replay", "--reason", REPLAY_REASON, stdout=out, stderr=StringIO())
        return int(
            scalar("SELECT count(*) FROM guardrails_deadletter WHERE id = ANY(%s) AND status = 'replayed'", [ids])
        )

    def action() -> int:
        form = {
            "action": "replay_selected",
            "select_across": "1",
            "index": "0",
            "_selected_action": [ids[0]],
            "post": "yes",
        }
        page = client.post(f"{changelist}?reason__exact={REPLAY_REASON}&status__exact=open", form)
        assert page.status_code == 302, page.status_code
        return int(
            scalar("SELECT count(*) FROM guardrails_deadletter WHERE id = ANY(%s) AND status = 'replayed'", [ids])
        )

    def bulk() -> int:
        # The job's body (django_celery_guardrails.bulk.run): batches of 500, a LogEntry each
        from django_celery_guardrails.bulk import Matching, run

        return run("replay", Matching.now(reason=REPLAY_REASON), user=user).done

    def plain() -> int:
        # The floor: the same number of messages published with plain Celery on one producer (no records, no
        # guardrails). With a Redis result backend Celery subscribes to each task's result channel as it
        # publishes and unsubscribes when the AsyncResult goes (celery/backends/redis.py: on_task_call).
        app = current_app()
        with app.producer_or_acquire() as producer:
            for n in range(len(ids)):
                app.send_task(RECEIPT, args=[n], producer=producer)
        return len(ids)

    goal = len(ids) / 1000  # 10 s for 10,000 (#13), as much a record for any other number
    runs: list[tuple[Figure, Callable[[], int]]] = [
        (Figure(f"  publish {len(ids):,} with plain Celery (the floor)", None), plain),
        (Figure(f"replay {len(ids):,}: replay_dead_letters()", goal), function),
        (Figure(f"replay {len(ids):,}: manage.py guardrails_replay", goal), command),
        (Figure(f"replay {len(ids):,}: admin action (select all, filtered)", goal), action),
        (Figure(f"replay {len(ids):,}: bulk job's body (all matching)", goal), bulk),
    ]
    # #34: the "all matching" page's count and dry run (the replay's check of the first 2,000), at most 1 s
    bulk_page = Figure(f"replay all matching page: count {len(ids):,}, dry run of 2,000", 1.0)
    reopen_replay_set(ids)
    url = reverse("admin:guardrails_deadletter_bulk", args=["replay"])
    for _ in range(rounds):
        elapsed, page = timed(lambda: client.get(url, {"reason__exact": REPLAY_REASON}))
        bulk_page.seconds.append(elapsed)
        shown = f"{len(ids)} open dead letters match".encode() in page.content
        bulk_page.note = "count shown" if page.status_code == 200 and shown else f"status {page.status_code}"
    figures.append(bulk_page)
    print(bulk_page.line(), flush=True)
    # Round by round, each way once, in an order that turns with the round (so that none is always measured
    # last), each from the same start (the records open again, the table vacuumed) and each right after a floor
    # of its own: #33's goal is a ratio, and this machine's speed drifts over the minutes a round of 40,000 takes.
    floor, ways = runs[0][0], runs[1:]
    floors: dict[str, list[float]] = {figure.name: [] for figure, _ in ways}
    for round_ in range(rounds):
        turn = round_ % len(ways)
        for figure, run in ways[turn:] + ways[:turn]:
            for measured, timed_run in ((floor, plain), (figure, run)):
                reopen_replay_set(ids)
                elapsed, replayed = timed(timed_run)
                queued = current_app().connection_for_write().default_channel.client.llen("scale")
                measured.seconds.append(elapsed)
                logs = scalar("SELECT count(*) FROM django_admin_log")
                measured.note = (
                    f"published {queued:,}"
                    if timed_run is plain
                    else f"replayed {replayed:,}, published {queued:,}, LogEntries {logs:,}"
                )
            floors[figure.name].append(floor.seconds[-1])
    figures.append(floor)
    print(floor.line(), flush=True)
    for figure, _ in ways:
        ratios = [took / base for took, base in zip(figure.seconds, floors[figure.name], strict=True)]
        verdict = "ok" if statistics.median(ratios) <= REPLAY_RATIO_GOAL else "OVER"
        figure.note += (
            f"; {statistics.median(ratios):.2f}x plain Celery ({min(ratios):.2f}-{max(ratios):.2f}), goal "
            f"{REPLAY_RATIO_GOAL}x: {verdict}"
        )
        figures.append(figure)
        print(figure.line(), flush=True)


def bench_watchdog(figures: list[Figure], policies: dict[str, dict[str, Any]], now: float) -> None:
    from celery_guardrails.scheduling.watchdog import check
    from django_celery_guardrails.health import schedule_health

    app = current_app()
    app.conf.guardrails = {**(app.conf.guardrails or {}), "schedules": {**app.conf.guardrails["schedules"], **policies}}
    watchdog = Figure(f"watchdog pass over {len(policies):,} schedules", 1.0)
    health = Figure(f"schedule health of {len(policies):,} schedules", 1.0)
    for _ in range(ROUNDS):
        elapsed, findings = timed(lambda: check(app, current=now))
        watchdog.seconds.append(elapsed)
        watchdog.note = f"missed {len(findings.missed)}, overdue {len(findings.overdue)}"
        elapsed, lines = timed(lambda: schedule_health(app, now=now))
        health.seconds.append(elapsed)
        health.note = (
            f"{len(lines):,} lines, {sum(line.state == 'ok' or line.state == 'running' for line in lines):,} ok"
        )
    for figure in (watchdog, health):
        figures.append(figure)
        print(figure.line(), flush=True)


class LongestTransaction:
    """The longest transaction of one backend, polled from pg_stat_activity by a second connection."""

    def __init__(self, database: str, pid: int) -> None:
        self.database, self.pid = database, pid
        self.longest = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with psycopg.connect(dbname=self.database, autocommit=True, **PG) as watcher:  # type: ignore[arg-type]
            while not self.stop.is_set():
                row = watcher.execute(
                    "SELECT extract(epoch FROM clock_timestamp() - xact_start) FROM pg_stat_activity "
                    "WHERE pid = %s AND xact_start IS NOT NULL",
                    [self.pid],
                ).fetchone()
                if row and row[0] is not None:
                    self.longest = max(self.longest, float(row[0]))
                self.stop.wait(0.01)

    def __enter__(self) -> LongestTransaction:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def bench_prune(figures: list[Figure], database: str) -> None:
    from django.core.management import call_command

    pid = int(scalar("SELECT pg_backend_pid()"))
    figure = Figure("guardrails_prune (rounds of 150, 135, ... days)", None)
    locks = Figure("  longest transaction during prune", 1.0)
    deleted = 0
    for round_ in range(ROUNDS):
        before = int(scalar("SELECT count(*) FROM guardrails_deadletter"))
        with LongestTransaction(database, pid) as watch:
            elapsed, _ = timed(
                lambda round_=round_: call_command(
                    # (past ten rounds, the last age again: an age is positive)
                    "guardrails_prune",
                    "--older-than",
                    f"{150 - 15 * min(round_, 9)}d",
                    stdout=StringIO(),
                )
            )
        deleted += before - int(scalar("SELECT count(*) FROM guardrails_deadletter"))
        figure.seconds.append(elapsed)
        locks.seconds.append(watch.longest)
    figure.note = f"deleted {deleted:,} dead letters in {ROUNDS} rounds (goal: batches, no lock over 1 s)"
    for item in (figure, locks):
        figures.append(item)
        print(item.line(), flush=True)


def main() -> None:
    figures: list[Figure] = []
    print(f"Scale: {ROWS:,} dead letters, replay {REPLAY:,}, {SCHEDULES:,} schedules x {RUNS} runs, {ROUNDS} rounds.")
    print(
        f"Load average at the start: {load()} ({os.cpu_count()} cores; other work on the machine slows every figure)."
    )
    with private_redis() as broker, private_database() as database:
        set_up_django(database, broker)
        from django.core.management import call_command

        started = time.perf_counter()
        call_command("migrate", verbosity=0)
        print(f"Migrated {database} in {time.perf_counter() - started:.0f} s.", flush=True)
        now = time.time()
        load_dead_letters()
        policies = load_schedules(now)
        execute("VACUUM ANALYZE")
        header = f"{'operation':<58} {'median':>9}  {'range':<19} {'goal':>10}"
        print(f"\n{header}\n{'-' * len(header)}", flush=True)
        bench_change_list(figures)
        bench_replay(figures)
        bench_watchdog(figures, policies, now)
        bench_prune(figures, database)
        print(f"\n{header}\n{'-' * len(header)}")
        for figure in figures:
            print(figure.line())
        print(f"Load average at the end: {load()}.")


if __name__ == "__main__":
    main()
