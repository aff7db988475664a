"""The example project end to end (``make demo``).

Migrates the project's SQLite database, starts a real ``celery worker`` (on Redis when one answers on
127.0.0.1:6379, else on Kombu's filesystem transport, which needs no server; ``DEMO_BROKER=filesystem``
forces it), sends requests and messages through ``GuardedTask``, prints what the worker saw, and stops
everything it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VAR = Path(os.environ.get("EXAMPLE_VAR_DIR", ROOT / "example_project" / "var"))
CLOCK_SPEED = 20
#: This run's name: its queues, task ids and Redis keys (``KEY_PREFIX``) are its own.
RUN = os.environ.get("DEMO_RUN") or uuid.uuid4().hex[:12]
KEY_PREFIX = f"demo-{RUN}:"


def redis_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return True
    except OSError:
        return False


def configure() -> str:
    """Point the example project at a broker and say which."""
    VAR.mkdir(parents=True, exist_ok=True)
    # A fresh database each run: idempotency keys live 7 days, and the demo charges the same orders again.
    (VAR / "db.sqlite3").unlink(missing_ok=True)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "example_project.settings",
            # Queues, task ids and (on Redis) every key are the run's own: two runs on one machine (or two
            # containers with the same pid) never consume each other's messages.
            "EXAMPLE_QUEUE": f"demo-{RUN}",
            "EXAMPLE_SQLITE_PATH": str(VAR / "db.sqlite3"),
            # Scheduled work at 20x speed (a minute in 3 s; see celery_guardrails.scheduling.beat.accelerated_clock),
            # the watchdog looking every second.
            "GUARDRAILS_CLOCK": f"{time.time()}:{CLOCK_SPEED}",
            "EXAMPLE_WATCHDOG_INTERVAL": "1",
            "EXAMPLE_ACTIVITY_FLUSH_INTERVAL": "2",
            # An ordering gap alerted after 2 s and given up after 6 s (the demo reads the status in between);
            # an outbox message that cannot be published dead-lettered at its third try (settings.py).
            "EXAMPLE_ORDERING_GAP_ALERT_AFTER": "2",
            "EXAMPLE_ORDERING_GAP_TIMEOUT": "6",
            "EXAMPLE_OUTBOX_MAX_ATTEMPTS": "3",
        }
    )
    if os.environ.get("DEMO_BROKER") != "filesystem" and redis_answers():
        # Any database (DEMO_REDIS_DB, default 14): every key the broker and the result backend write starts
        # with the run's own prefix (kombu's and Celery's global_keyprefix), so a database shared with another
        # run, or with anything else, is neither read nor changed outside it.
        url = f"redis://127.0.0.1:6379/{int(os.environ.get('DEMO_REDIS_DB', '14'))}"
        os.environ["EXAMPLE_BROKER_URL"] = os.environ["EXAMPLE_RESULT_BACKEND"] = url
        prefix = json.dumps({"global_keyprefix": KEY_PREFIX})
        os.environ["EXAMPLE_BROKER_TRANSPORT_OPTIONS"] = os.environ["EXAMPLE_RESULT_BACKEND_TRANSPORT_OPTIONS"] = prefix
        return f"Redis at {url}, keys prefixed {KEY_PREFIX}"
    folders = {name: VAR / "broker" / name for name in ("messages", "processed", "results", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    os.environ["EXAMPLE_BROKER_URL"] = "filesystem://"
    # kombu's transport, with each message file written whole before a consumer can take it (celery/kombu#1551)
    os.environ["EXAMPLE_BROKER_TRANSPORT"] = "example_project.filesystem_broker:Transport"
    os.environ["EXAMPLE_BROKER_TRANSPORT_OPTIONS"] = json.dumps(
        {
            "data_folder_in": str(folders["messages"]),
            "data_folder_out": str(folders["messages"]),
            "processed_folder": str(folders["processed"]),
            "store_processed": False,
            # Fanout exchanges (beat's and the worker's broadcasts): here, not in a "control" folder of the cwd.
            "control_folder": str(folders["control"]),
        }
    )
    os.environ["EXAMPLE_RESULT_BACKEND"] = f"file://{folders['results']}"
    return f"Kombu filesystem transport in {folders['messages']} (no Redis answered on 127.0.0.1:6379)"


def forget_keys(url: str) -> None:
    """Delete the run's own Redis keys (results, queues, bindings: all under ``KEY_PREFIX``), and no other."""
    if not url.startswith("redis://"):
        return
    import redis

    client = redis.Redis.from_url(url)
    with contextlib.suppress(redis.RedisError):  # a tidy-up: never what fails the demo
        for batch in _batches(client.scan_iter(match=f"{KEY_PREFIX}*", count=500), 500):
            client.delete(*batch)


def _batches(items: Any, size: int) -> Any:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def start_worker(
    log_path: Path,
    *,
    pool: str = "solo",
    concurrency: int = 1,
    queue: str = "",
    name: str = "demo",
    env: dict[str, str] | None = None,
    app: str = "example_project",
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-Q",
                queue or os.environ["EXAMPLE_QUEUE"],
                "-n",
                f"{name}@%h",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while " ready." not in log_path.read_text(errors="replace"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.2)
    return worker


def start_beat(log_path: Path) -> subprocess.Popen[bytes]:
    """``celery beat`` with the guarded django-celery-beat scheduler."""
    scheduler = "django_celery_guardrails.schedulers:GuardedDatabaseScheduler"
    with log_path.open("wb") as log:
        beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project", "beat", "-S", scheduler, "-l", "INFO"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return beat


class DemoTimeout(SystemExit):
    """A wait of the demo that passed its deadline: the demo stops (its workers too) and says what it waited for."""


def wait_for(what: str, probe: Any, timeout: float = 60, every: float = 0.2) -> Any:
    """Poll ``probe`` until it returns something truthy, and return that; past ``timeout`` seconds, stop the
    demo with a message naming ``what`` (every wait of the demo has a deadline: nothing hangs silently)."""
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        if time.monotonic() > deadline:
            raise DemoTimeout(f"demo: gave up after {timeout:g}s waiting for {what}")
        time.sleep(every)
    return found


def outcome(result: Any, what: str, timeout: float = 60) -> Any:
    """The return value of a task (its exception raised, as ``get`` does), waited for ``timeout`` seconds at
    most; past that, the demo stops with a message naming ``what``, the task id and its state."""
    from celery.exceptions import TimeoutError as ResultTimeout

    try:
        return result.get(timeout=timeout)
    except ResultTimeout:
        raise DemoTimeout(
            f"demo: gave up after {timeout:g}s waiting for {what} (task {result.id}, state {result.state}; is a "
            f"worker consuming queue {os.environ.get('EXAMPLE_QUEUE')}? see the logs in {VAR})"
        ) from None


def stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def main() -> None:
    sys.path.insert(0, str(ROOT))
    broker = configure()
    print(f"== broker: {broker}")
    subprocess.run(
        [sys.executable, str(ROOT / "example_project" / "manage.py"), "migrate", "--noinput", "-v", "0"],
        check=True,
        cwd=ROOT,
        timeout=300,
    )
    print(f"== migrated {os.environ['EXAMPLE_SQLITE_PATH']}")

    import django

    django.setup()
    from django.test import Client

    from example_project.celery_app import app
    from example_project.shop.fake_provider import FlakyProvider

    provider = FlakyProvider(flaky={42: 2}).__enter__()
    os.environ["EXAMPLE_PAYMENTS_URL"] = provider.url  # the worker inherits it
    print(f"== payments provider stand-in at {provider.url}: order 42 gets two 503s before its 201")
    log_path = VAR / "demo-worker.log"
    worker = start_worker(log_path)
    print(f"== worker started (pid {worker.pid}, solo pool, queue {os.environ['EXAMPLE_QUEUE']}, log {log_path})")
    try:
        client = Client()

        print(
            "\n-- 1. tenant and correlation context: POST /orders/42/receipt as tenant acme, X-Request-ID demo-req-42"
        )
        response = client.post("/orders/42/receipt", headers={"X-Tenant": "acme", "X-Request-ID": "demo-req-42"})
        body = response.json()
        print(
            f"   web:    HTTP {response.status_code}, task {body['task_id']}, tenant={body['tenant']}, "
            f"correlation id={body['correlation_id']}"
        )
        seen = outcome(app.AsyncResult(body["task_id"]), "the receipt of order 42", 30)
        print(f"   worker: tenant={seen['tenant']}, correlation id={seen['correlation_id']} (on {seen['worker']})")

        print("\n-- 2. tenant_required at publish: the same request without X-Tenant")
        response = client.post("/orders/43/receipt")
        print(f"   web:    HTTP {response.status_code}: {response.json()['error']}")

        print("\n-- 3. tenant_required on the worker: a tenant-less message sent by name, as another service would")
        result = app.send_task("example_project.shop.tasks.send_receipt", args=[44])
        try:
            outcome(result, "the refusal of the tenant-less receipt 44", 30)
        except Exception as exc:  # the refusal, raised back from the result backend
            print(f"   worker: refused without running, state {result.state}: {type(exc).__name__}: {exc}")

        print("\n-- 4. classified retries: charge order 42 through the flaky provider (transient 503s)")
        response = client.post("/orders/42/charge?amount=1999", headers={"X-Tenant": "acme"})
        charged = outcome(app.AsyncResult(response.json()["task_id"]), "the charge of order 42", 60)
        for record in charged["history"]:
            print(
                f"   attempt {record['n']}: {record['exc']} ({record['msg'][:40]}) -> {record['class']} "
                f"by rule {record['rule']}, retried after {record['delay']:.3f}s"
            )
        print(
            f"   attempt {charged['attempt']}: charged, {charged['charge']} "
            f"(the provider saw {provider.calls[42]} requests)"
        )

        print("\n-- 5. a validation error is permanent: charge order 43 with amount -5")
        response = client.post("/orders/43/charge?amount=-5", headers={"X-Tenant": "acme"})
        failed = app.AsyncResult(response.json()["task_id"])
        try:
            outcome(failed, "the refusal of order 43's charge", 30)
        except Exception as exc:
            print(
                f"   worker: {type(exc).__name__}: {exc}; state {failed.state}, provider requests: {provider.calls[43]}"
            )
        finals = [
            line
            for line in log_path.read_text(errors="replace").splitlines()
            if failed.id in line and "failed finally" in line
        ]
        for line in finals:
            print(f"   log: {line.split('] ', 1)[-1]}")

        print("\n-- 6. idempotency: the message charging order 77 is delivered three times")
        from celery_guardrails import tenant_context
        from example_project.shop.tasks import charge_order

        with tenant_context("acme"):
            copies = [charge_order.apply_async((77, 2500), task_id=f"demo-charge-77-{RUN}") for _ in range(3)]
        first = outcome(copies[0], "the first delivery of order 77's charge", 60)
        deadline = time.monotonic() + 30
        log_text = ""
        while time.monotonic() < deadline:
            log_text = log_path.read_text(errors="replace")
            if log_text.count("charge:77 already completed") >= 2:
                break
            time.sleep(0.2)
        print(f"   deliveries: 3; body ran: {provider.calls[77]} time(s), charge {first['charge']}")
        print(
            f"   duplicates skipped: {log_text.count('charge:77 already completed')} "
            f"(each returned the first's result); the provider holds {provider.charges[77]} charge for order 77"
        )

        print("\n-- 7. dead letters: the provider declines order 88's card (HTTP 402: permanent)")
        from django_celery_guardrails.models import DeadLetter, SealedMessage
        from django_celery_guardrails.replay import replay_dead_letters

        provider.declined.add(88)
        card = "tok_live_4242_demo"  # a secret: the record shows it redacted and keeps it only sealed
        response = client.post(
            "/orders/88/charge?amount=4200",
            data=json.dumps({"card_token": card}),
            content_type="application/json",
            headers={"X-Tenant": "acme"},
        )
        declined = app.AsyncResult(response.json()["task_id"])
        with contextlib.suppress(Exception):  # the failure itself; the record says what it was
            outcome(declined, "the declined charge of order 88", 30)
        record = DeadLetter.objects.get(task_id=declined.id)
        print(f"   worker: {record.exc_type}: {record.exc_message}")
        from django_celery_guardrails.overview import causes

        cause = next(c for c in causes() if c.fingerprint == record.fingerprint)
        print(
            f"   cause {cause.fingerprint} (the overview's groups): {cause.title}; {cause.count} open record(s) of it"
        )
        print(
            f"   dead letter #{record.pk}: reason {record.reason}, owner {record.owner}, tenant {record.tenant}, "
            f"status {record.status}, {len(record.history)} attempt record(s)"
        )
        stored = repr(list(DeadLetter.objects.filter(pk=record.pk).values()))
        sealed = SealedMessage.objects.filter(dead_letter=record).exists()
        print(
            f"   arguments as stored: {record.args} {record.kwargs}; card token in the row: {card in stored}; "
            f"sealed copy kept for replay: {sealed}"
        )
        print(
            f"   admin: http://127.0.0.1:8000/admin/guardrails/deadletter/{record.pk}/change/ "
            "(python example_project/manage.py runserver, after createsuperuser)"
        )
        provider.declined.discard(88)  # the customer updated their card: the cause is fixed
        replayed = replay_dead_letters([record.pk], app=app)
        ((_, new_task_id),) = replayed.replayed
        recharged = outcome(app.AsyncResult(new_task_id), "the replayed charge of order 88", 60)
        record.refresh_from_db()
        print(
            f"   fixed and replayed as {new_task_id}: charged {recharged['charge']} with card "
            f"{provider.cards[88]!r} (the real token, from the sealed copy); dead letter status {record.status}"
        )

        scheduled_work(app, log_path)
        shared_capacity(app)
        killed_mid_handover(app)
        status_table(app)
        contract_and_outbox()
        audit()
        retry_gate(app, provider)
        hostile_input(app, log_path)
        ordering_gap(app, log_path)
        unpublishable(app)
        from example_project.demo_jobs import DemoTools, jobs

        jobs(DemoTools(wait_for=wait_for, start_worker=start_worker, stop=stop, var=VAR), client)

        print("\n-- the worker's log lines for request demo-req-42 (tenant and correlation id on each line)")
        for line in log_path.read_text(errors="replace").splitlines():
            if "demo-req-42" in line:
                print(f"   {line}")
    finally:
        stop(worker)
        provider.__exit__()
        forget_keys(str(app.conf.broker_url))
        print(f"\n== worker stopped (exit code {worker.returncode})")


def shared_capacity(app: Any) -> None:
    """A tenant's burst of reports, limited to 2 at once across workers; another tenant's run beside them."""
    from celery_guardrails import concurrency_status, tenant_context
    from example_project.shop.tasks import build_report

    queue = f"{os.environ['EXAMPLE_QUEUE']}-reports"
    print("\n-- 9. shared capacity: build_report has concurrency_key='tenant:{tenant}', concurrency_limit=2")
    log_path = VAR / "demo-reports-worker.log"
    worker = start_worker(log_path, pool="threads", concurrency=4, queue=queue, name="reports")
    print(f"   a second worker: threads pool, 4 at once (pid {worker.pid}, queue {queue}, log {log_path})")
    try:
        results = []
        for tenant, count in (("acme", 6), ("globex", 2)):
            with tenant_context(tenant):
                results += [build_report.apply_async((n,), queue=queue) for n in range(1, count + 1)]
        print("   published 6 reports for acme, then 2 for globex")
        peak = 0

        def all_done() -> bool:
            nonlocal peak
            peak = max(peak, concurrency_status("tenant:acme", app=app)["held"])
            return all(result.ready() for result in results)

        wait_for(f"the {len(results)} reports on queue {queue} (log {log_path})", all_done, timeout=120, every=0.1)
        runs = [outcome(result, f"report {n} of {len(results)}", 60) for n, result in enumerate(results, 1)]
        start = min(run["started"] for run in runs)
        for run in sorted(runs, key=lambda run: run["started"]):
            bar = " " * int((run["started"] - start) * 4) + "#" * max(1, int((run["ended"] - run["started"]) * 4))
            print(f"   {run['tenant']:>6} report {run['report_id']}: {bar}")

        def overlap(tenant: str) -> int:
            mine = [run for run in runs if run["tenant"] == tenant]
            # the most running at once: at some run's start, the runs started and not yet ended
            return max(sum(o["started"] <= run["started"] < o["ended"] for o in mine) for run in mine)

        acme_end = max(run["ended"] for run in runs if run["tenant"] == "acme")
        globex_end = max(run["ended"] for run in runs if run["tenant"] == "globex")
        print(
            f"   acme: at most {overlap('acme')} at once (slots held, sampled: at most {peak}); globex ran beside it "
            f"and was done {acme_end - globex_end:.1f}s before acme's last; attempts used: "
            f"{sorted({run['attempt'] for run in runs})} (waiting for a slot spends none)"
        )
    finally:
        stop(worker)


def status_table(app: Any) -> None:
    """The operator's view, as they would get it: ``celery -A example_project guardrails status``, after the
    activity the workers kept in the store (what the admin dashboard charts)."""
    from collections import Counter

    from celery_guardrails.foundation.clock import now
    from celery_guardrails.operations import activity

    print("\n-- 11. the activity the workers kept (outcomes per task; the admin dashboard charts it per hour)")

    def counted() -> Counter[tuple[str, str]]:
        current = now(app)
        totals: Counter[tuple[str, str]] = Counter()
        for count in activity.read(app, since=current - 86400, until=current + 60).outcomes:
            totals[(count.task, count.outcome)] += count.count
        return totals

    wait_for("the workers' counts in the store", lambda: bool(counted()))
    totals = counted()
    for task in sorted({task for task, _ in totals}):
        outcomes = ", ".join(f"{outcome} {n}" for (name, outcome), n in sorted(totals.items()) if name == task)
        print(f"   {task}: {outcomes}")
    print(
        "\n-- 12. celery -A example_project guardrails status (queues, open dead letters, dependencies, schedules, "
        "outbox, ordering waits)"
    )
    print_command([sys.executable, "-m", "celery", "-A", "example_project", "guardrails", "status"])
    print(
        "   the same numbers, with charts of the last 24 hours (dead letters by reason, outcomes per task, queue age): "
        "http://127.0.0.1:8000/admin/guardrails/dashboard/"
    )
    print(
        "   Prometheus: metrics=True, then the worker's metrics_port and the view guardrails/metrics (see Visibility)"
    )


def contract_and_outbox() -> None:
    """What a message may carry, checked at publish; and a message enqueued in a database transaction."""
    from django.contrib.auth.models import User
    from django.db import transaction

    from celery_guardrails import tenant_context
    from celery_guardrails.exceptions import PayloadContractError
    from django_celery_guardrails.models import OutboxMessage
    from example_project.shop.tasks import charge_order, send_receipt

    print("\n-- 13. the payload contract: refused at publish, in the caller, nothing sent")
    with tenant_context("acme"):
        for what, publish in (
            ("a model instance", lambda: send_receipt.delay(User(username="ada"))),
            ("a card number", lambda: charge_order.apply_async((45, 500), {"card_number": "4242424242424242"})),
            ("70 KB of arguments", lambda: charge_order.delay(46, 500, card_token="x" * 70_000)),
            ("arguments nested 150 levels", lambda: send_receipt.delay(nested(150))),
        ):
            try:
                publish()
            except PayloadContractError as exc:
                print(f"   {what}: {type(exc).__name__}: {exc}")

    print("\n-- 14. the transactional outbox: enqueue_in_transaction writes the message in the transaction")

    class Cancelled(Exception):
        pass

    with tenant_context("acme"):
        try:
            with transaction.atomic():
                charge_order.enqueue_in_transaction(47, 900)
                raise Cancelled
        except Cancelled:
            print(f"   order 47: the transaction rolled back; outbox messages: {OutboxMessage.objects.count()}")
        with transaction.atomic():
            result = charge_order.enqueue_in_transaction(48, 900)
        waiting = OutboxMessage.objects.count()
        print(f"   order 48: committed; outbox messages: {waiting} (the worker's relay publishes it)")
        charged = outcome(result, "the outbox's charge", 60)
    print(
        f"   order 48 charged {charged['charge']} by the worker; outbox messages left: {OutboxMessage.objects.count()} "
        "(a crash between the commit and the publish would have lost nothing: the row waits for the relay)"
    )


def audit() -> None:
    """The deployment graded against the rubric: ``manage.py guardrails_audit``."""
    print("\n-- 15. manage.py guardrails_audit (configuration, tasks, source and tests, scored 0-5 on nine axes)")
    print_command([sys.executable, str(ROOT / "example_project" / "manage.py"), "guardrails_audit"])


def retry_gate(app: Any, provider: Any) -> None:
    """The retry gate: whether a task may run again depends on what it did before it failed."""
    from celery_guardrails import tenant_context
    from django_celery_guardrails.models import DeadLetter
    from django_celery_guardrails.replay import replay_dead_letters
    from example_project.shop.tasks import ship_order

    print(
        "\n-- 16. the retry gate: ship_order books a parcel (its effect, marked with self.effect(); the carrier "
        "takes no key), then tells the warehouse"
    )
    provider.busy_carrier[51] = 1  # the carrier's first answer for order 51: 429, the request was not processed
    provider.warehouse_down.add(50)  # the warehouse answers 503 for order 50, after its parcel was booked
    with tenant_context("acme"):
        busy, down = ship_order.delay(51), ship_order.delay(50)
    shipped = outcome(busy, "the shipment of order 51", 60)
    for record in shipped["history"]:
        print(
            f"   order 51, attempt {record['n']}: {record['msg'][:45]} inside the effect -> {record['class']} by rule "
            f"{record['rule']}, retried after {record['delay']:.3f}s"
        )
    print(f"   order 51: shipped on attempt {shipped['attempt']}; parcels the carrier booked: {provider.bookings[51]}")
    with contextlib.suppress(Exception):  # the failure itself; the record says what it was
        outcome(down, "the failed shipment of order 50", 30)
    record = DeadLetter.objects.get(task_id=down.id)
    print(
        f"   order 50: {record.exc_message[:45]} after the booking -> {record.reason} after {record.attempts} "
        f"attempt(s), not retried; parcels the carrier booked: {provider.bookings[50]}"
    )
    print(f"   the dead letter's note: {record.history[-1].get('note')}")
    refused = replay_dead_letters([record.pk], app=app)
    ((_, why),) = refused.skipped
    print(f"   replay_dead_letters([{record.pk}]): replayed {len(refused.replayed)}, refused: {why[:60]}...")
    print(
        "   (allow_not_idempotent=True, guardrails_replay --allow-not-idempotent or the admin's tick replay it, once "
        "someone checked the parcel was not booked)"
    )


def nested(levels: int) -> Any:
    """A value ``levels`` lists deep."""
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def hostile_input(app: Any, worker_log: Path) -> None:
    """Messages another producer wrote (no payload contract there): each ends as a dead letter that gives nothing
    away, and the worker goes on."""
    from celery_guardrails import tenant_context
    from django_celery_guardrails.models import DeadLetter
    from example_project.shop.tasks import send_receipt

    print("\n-- 17. hostile input: messages another producer wrote, past the payload contract")
    dsn = "postgresql://shop:Sup3rS3cret@db.internal/shop"
    sent = {}
    with app.producer_or_acquire() as producer:
        for what, args, kwargs in (
            ("arguments nested 700 levels (a prefork worker's pickle stops the worker there)", [nested(700)], {}),
            ("a database URL under an innocent name, an argument the task does not take", [49], {"dsn": dsn}),
        ):
            message = app.amqp.as_task_v2(f"demo-hostile-{len(sent)}-{RUN}", send_receipt.name, args, kwargs)
            headers = {**message.headers, "guardrails": {"v": 1, "tenant": "acme"}}
            producer.publish(message.body, routing_key=os.environ["EXAMPLE_QUEUE"], headers=headers, serializer="json")
            sent[what] = message.headers["id"]
    for what, task_id in sent.items():
        record = wait_for(
            f"the dead letter of {task_id} ({what})",
            lambda task_id=task_id: DeadLetter.objects.filter(task_id=task_id).first(),
        )
        print(f"   {what}:")
        print(f"      dead letter #{record.pk} {record.reason}: {record.exc_message[:110]}")
        if record.kwargs:
            print(f"      arguments as stored: {record.args} {record.kwargs}")
    with tenant_context("acme"):
        after = outcome(send_receipt.delay(50), "receipt 50 after the hostile messages", 30)
    logged = dsn in worker_log.read_text(errors="replace")
    print(f"   the worker went on (receipt {after['order_id']} sent next); the password in its log: {logged}")


def ordering_gap(app: Any, worker_log: Path) -> None:
    """Stock counts ordered per SKU, one of them handed its number and never published: the wait backs off, is
    seen in the status and the metrics, alerts the owner, and ends with the missing number recorded."""
    from celery_guardrails import tenant_context
    from celery_guardrails.guardrails.idempotency import scoped_key
    from celery_guardrails.operations import status
    from celery_guardrails.operations.collectors import StateCollector
    from celery_guardrails.options import resolve
    from celery_guardrails.stores import get_store
    from django_celery_guardrails.models import DeadLetter
    from django_celery_guardrails.replay import replay_dead_letters
    from example_project.shop.tasks import update_stock

    alert_after, timeout = (
        resolve(update_stock, name, {}) for name in ("ordering_gap_alert_after", "ordering_gap_timeout")
    )
    print(
        f"\n-- 18. ordering gaps: update_stock has ordering_key='sku:{{sku}}'; here ordering_gap_alert_after="
        f"{alert_after:g}s, ordering_gap_timeout={timeout:g}s"
    )
    sku = "SKU-1001"
    key = scoped_key(update_stock.name, "acme", f"sku:{sku}")
    retention = resolve(update_stock, "ordering_retention", {})
    lost = get_store(app).order_next(key, now=time.time(), retention=retention)
    print(f"   count #{lost} of {sku}: its publisher took the number from the store, then died before publishing")
    with tenant_context("acme"):
        second = update_stock.delay(sku, "c2", 40)
    print("   the next count (level 40) published; the worker holds it back")

    def alert_lines() -> list[str]:
        lines = worker_log.read_text(errors="replace").splitlines()
        return [line for line in lines if "ALERT" in line and f"Ordering key waits: {key}" in line]

    alerts = wait_for("the ordering alert", alert_lines, timeout=30)
    text = status.render(status.gather(app))
    print("   celery -A example_project guardrails status, its part on ordering (status.gather, read now):")
    for line in text.split("Ordering waits\n", 1)[1].split("\n\n", 1)[0].splitlines():
        print(f"   {line}")
    # The message held back is in no queue while it waits for its turn: the status's Waiting section lists it
    print("   and its part on waiting work (also the admin's Waiting page):")
    for line in text.split("Waiting (", 1)[1].split("\n\n", 1)[0].splitlines()[1:]:
        print(f"   {line}")
    samples = {s.name: s.value for f in StateCollector(app, close_database=False).collect() for s in f.samples}
    waiting, oldest = (f"celery_guardrails_ordering_{name}" for name in ("keys_waiting", "oldest_wait_seconds"))
    print(f"   metrics: {waiting} {samples[waiting]:g}, {oldest} {samples[oldest]:.1f}")
    for line in alerts:  # the subject, without the JSON the log line carries after it
        print(f"   alert{line.split('ALERT', 1)[1].split(' {', 1)[0]}")
    first = outcome(second, "the ordered stock updates", 60)
    record = DeadLetter.objects.get(task_name=update_stock.name, reason="ordering_gap_skipped")
    held = (record.last_failed_at - record.first_failed_at).total_seconds()
    looks = [entry["delay"] for entry in first["history"] if entry.get("rule") == "ordering:wait"]
    fixed = resolve(update_stock, "retry_later_delay", {})
    print(
        f"   #{first['sequence']} looked back {len(looks)} times in the {held:.1f}s wait, after "
        f"{', '.join(f'{delay:.2f}' for delay in looks)} s"
    )
    print(
        f"      (retry_later_delay={fixed:g}s at first, then about as long as the key had been stuck, cut to look at "
        f"the alert and the timeout; a fixed {fixed:g}s would have made about {held / fixed:.0f})"
    )
    print(f"   then it gave #{lost} up and ran: {sku} at {first['level']} (#{first['sequence']})")
    print(
        f"   dead letter #{record.pk} {record.reason}: key {record.header['ord']}, number {record.header['ord_seq']}, "
        f"owner {record.owner}, arguments {record.args}, attempts {record.attempts}"
    )
    for line in textwrap.wrap(record.exc_message, 110):
        print(f"      {line}")
    refused = replay_dead_letters([record.pk], app=app)
    ((_, why),) = refused.skipped
    print(f"   replay_dead_letters([{record.pk}]): replayed {len(refused.replayed)}, refused:")
    for line in textwrap.wrap(why, 110):
        print(f"      {line}")


def unpublishable(app: Any) -> None:
    """An outbox message no worker can publish: kept with its error and attempts, then a dead letter."""
    from django.db import transaction
    from django.utils import timezone

    from celery_guardrails import GuardedTask, tenant_context
    from celery_guardrails.options import app_value
    from django_celery_guardrails.models import DeadLetter, OutboxMessage

    limit = app_value(app, "outbox_max_attempts")
    print(f"\n-- 19. the outbox keeps the ack rule: a message no relay can publish (here outbox_max_attempts={limit})")

    # A task of the next release: this web process has it; the workers, still on the release before, do not.
    @app.task(base=GuardedTask, bind=True, name="example_project.shop.tasks.refund_order", tenant_required=True)
    def refund_order(self: Any, order_id: int) -> None:
        """Refund an order (never runs here)."""

    with tenant_context("acme"), transaction.atomic():
        refund = refund_order.enqueue_in_transaction(48)
    print("   refund_order(48) enqueued in a committed transaction by a web process of the next release")
    seen: list[int] = []

    def watch() -> bool:
        row = OutboxMessage.objects.filter(task_id=refund.id).first()
        if row is not None and row.attempts and row.attempts not in seen:
            seen.append(row.attempts)
            print(f"   the worker's relay, attempt {row.attempts} of {limit}: {row.last_error}")
            print(
                f"      the row is kept (attempts {row.attempts}, its error), tried again in "
                f"{(row.available_at - timezone.now()).total_seconds():.0f}s"
            )
        return row is None

    wait_for("the row dead-lettered", watch, timeout=60)
    record = DeadLetter.objects.get(task_id=refund.id)
    print(
        f"   attempt {record.attempts} of {limit}: dead letter #{record.pk} {record.reason}, owner {record.owner}, "
        f"tenant {record.tenant}, arguments {record.args}"
    )
    print(
        f"   outbox messages left: {OutboxMessage.objects.count()} (the row was deleted in the record's transaction: "
        "never gone unrecorded)"
    )


def print_command(argv: list[str]) -> None:
    """Run an operator's command as they would, and print what it printed, indented."""
    shown = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    for line in (shown.stdout + shown.stderr).splitlines():
        print(f"   {line}")


def killed_mid_handover(app: Any) -> None:
    """A worker SIGKILLed while the broker hands it a message: the message is not lost (Redis broker only)."""
    import redis

    from celery_guardrails import tenant_context
    from example_project.shop.tasks import send_receipt

    print("\n-- 10. a worker killed as a message is handed to it (broker_atomic_pop, Redis broker)")
    url = str(app.conf.broker_url)
    if not url.startswith("redis://"):
        print("   skipped: the broker is not Redis here")
        return
    broker = redis.Redis.from_url(url)
    queue, name = f"{os.environ['EXAMPLE_QUEUE']}-handover", f"demo-handover-{RUN}"
    queue_key = str((app.conf.broker_transport_options or {}).get("global_keyprefix", "")) + queue
    # A long server-side wait, so that the worker is still waiting when it is frozen.
    options = {**app.conf.broker_transport_options, "client_name": name, "guardrails_pop_wait": 60}
    env = {"EXAMPLE_BROKER_TRANSPORT_OPTIONS": json.dumps(options)}

    def waiting() -> bool:
        return any(c.get("name") == name and "b" in c.get("flags", "") for c in broker.client_list())

    log_path = VAR / "demo-handover-worker.log"
    worker = start_worker(log_path, queue=queue, name="handover", env=env)
    try:
        wait_for("the worker waiting for its queue", waiting)
        os.kill(worker.pid, signal.SIGSTOP)
        print(f"   worker {worker.pid} waits for queue {queue} on the server; frozen there (SIGSTOP)")
        with tenant_context("acme"):
            result = send_receipt.apply_async((77,), queue=queue)
        wait_for("the server done with the waiting worker", lambda: not waiting())
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        print(f"   receipt 77 published, then the worker SIGKILLed; messages left in {queue}: {broker.llen(queue_key)}")
    finally:
        stop(worker)
    worker = start_worker(log_path, queue=queue, name="handover-next")
    try:
        receipt = outcome(result, "the receipt after the handover", 60)
        print(
            f"   the next worker sent receipt {receipt['order_id']} for tenant {receipt['tenant']}: with kombu's BRPOP "
            "the server would have handed the message to the dead worker, and it would be gone (celery/kombu#305)"
        )
    finally:
        stop(worker)
        broker.delete(queue_key)


def scheduled_work(app: Any, worker_log: Path) -> None:
    from celery_guardrails.log import moment_text
    from celery_guardrails.scheduling.beat import moment
    from celery_guardrails.scheduling.ledger import MISSED, OK
    from celery_guardrails.stores import get_store

    name = "settle-payments"
    print(f"\n-- 8. scheduled work: {name!r} every minute, Europe/Berlin, overlap skip, catch_up latest, since=True")
    print(f"   (the demo's clock runs {CLOCK_SPEED}x faster: a minute passes in {60 / CLOCK_SPEED:g} s)")
    store = get_store(app)
    beat_log = VAR / "demo-beat.log"
    beat = start_beat(beat_log)
    try:
        first = wait_for("a settlement", lambda: [r for r in store.run_list(name) if r.status == OK])[-1]
    finally:
        stop(beat)
    settled = outcome(app.AsyncResult(first.task_id), "the settlement's result", 30)
    print(f"   beat dispatched period {moment(first.period):%H:%M} UTC; it ran ok, since={settled['since']}")
    print("   beat stopped")

    def missed_runs() -> list[Any]:
        runs = store.run_list(name, statuses=(MISSED,))[::-1]  # oldest first
        # The two periods after the settlement: on a busy machine the watchdog may have recorded a third.
        return runs[:2] if len(runs) >= 2 else []

    missed = wait_for("two missed periods", missed_runs)

    def alert_lines(run: Any) -> list[str]:
        lines = [line for line in worker_log.read_text(errors="replace").splitlines() if "ALERT" in line]
        return [line for line in lines if f"{name} at {moment_text(run.period)}" in line]

    alerts = wait_for("the alert", lambda: alert_lines(missed[0]))
    for run in missed:
        print(f"   watchdog (in the worker): period {moment(run.period):%H:%M} UTC {run.status}: {run.reason}")
    for line in alerts:
        print(f"   alert{line.split('ALERT', 1)[1][:90]}")
    print(
        f"   period {moment(missed[1].period):%H:%M} UTC: {len(alert_lines(missed[1]))} more alert(s); the outage is "
        "one incident, counted for one summary when it ends (run_alert_throttle)"
    )
    beat = start_beat(beat_log)
    try:
        caught = wait_for(
            "the catch-up",
            lambda: [r for r in store.run_list(name) if r.status == OK and r.period > missed[0].period],
        )[-1]
    finally:
        stop(beat)
    result = outcome(app.AsyncResult(caught.task_id), "the caught-up settlement's result", 30)
    late = [r for r in store.run_list(name) if first.period < r.period <= caught.period]
    print(
        f"   beat restarted: caught up the latest missed period, {moment(caught.period):%H:%M} UTC, once "
        f"(since={result['since']}, the end of the last settlement, read from the run ledger)"
    )
    for run in reversed(late):
        print(f"   ledger: {moment(run.period):%H:%M} UTC {run.status}")


if __name__ == "__main__":
    main()
