"""Replay and the admin: permissions, confirmation, LogEntry, one publish per record however many replays."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import pytest
from celery.signals import before_task_publish
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from kombu import Producer

from celery_guardrails import tenant_context
from celery_guardrails.guardrails.scheduled_runs import slot_key
from celery_guardrails.runtime.effects import provider_key
from celery_guardrails.runtime.outcomes import NOT_IDEMPOTENT
from celery_guardrails.stores import get_store
from django_celery_guardrails.models import DeadLetter
from django_celery_guardrails.replay import (
    NOT_IDEMPOTENT_REFUSAL,
    Refused,
    plan,
    refusals,
    replay_dead_letters,
    replay_with_changes,
)
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.admin_users import staff_user
from tests.support.dead_letters import held_once_recorded
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


def dead_letter(sink: Sink, oid: int) -> DeadLetter:
    """A real dead letter: charge fails permanently on its first run (the script), for tenant acme."""
    with tenant_context("acme"):
        result = tasks.charge.apply_async((oid, sink.key, ["permanent", "ok"]), correlation_id="req-replay-1")
    with pytest.raises(Exception, match="card refused"):
        result.get(timeout=TIMEOUT)
    return DeadLetter.objects.get(task_id=result.id)


@pytest.fixture
def oid() -> int:
    return uuid.uuid4().int % 10**9


def test_replay_after_the_fix_keeps_tenant_correlation_and_key(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    record = dead_letter(sink, oid)
    assert record.idempotency_key == f"tests.proj.tasks.charge:acme:charge:{oid}"
    # the cause is "fixed": the script's second run succeeds
    result = replay_dead_letters(DeadLetter.objects.filter(pk=record.pk), user=staff_user("replay_deadletter"))
    ((replayed_pk, task_id),) = result.replayed
    assert replayed_pk == record.pk
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"charged {oid}"
    second = sink.items()[-1]
    assert (second["tenant"], second["cid"], second["attempt"], second["key"]) == (
        "acme",
        "req-replay-1",
        1,
        provider_key(record.idempotency_key),  # the body is handed the opaque key made from the same scoped one
    )
    record.refresh_from_db()
    assert (record.status, record.replayed_task_id) == ("replayed", task_id)


def test_two_replays_in_parallel_publish_once(celery_worker: Any, celery_app: Any, sink: Sink, oid: int) -> None:
    record = dead_letter(sink, oid)
    results: list[Any] = []
    barrier = threading.Barrier(2)

    def replay() -> None:
        barrier.wait()
        results.append(replay_dead_letters([record.pk]))
        from django.db import connection

        connection.close()

    threads = [threading.Thread(target=replay) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(len(r.replayed) for r in results) == [0, 1]
    assert [why for r in results for _, why in r.skipped] in (
        ["already handled by someone else"],
        ["status is replayed"],
    )


@pytest.mark.parametrize("store", ["redis", "django"])
def test_a_replay_published_before_its_run_wrote_the_key_failed_reopens_the_key_and_runs(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, store: str
) -> None:
    if store == "django":
        celery_app.conf.guardrails = {**celery_app.conf.guardrails, "store": "django"}
    # Given a charge that fails for good, whose worker, once the dead letter is durable, is held until the
    # record has been replayed: its key is written failed only after the replay's publish (the window between)
    first_id = str(uuid.uuid4())
    with held_once_recorded(first_id, timeout=TIMEOUT) as recorded:
        first = tasks.charge.apply_async((oid, sink.key, ["permanent", "ok"]), task_id=first_id)
        assert recorded.wait(TIMEOUT)
        record = DeadLetter.objects.get(task_id=first_id)
        key = get_store(celery_app).inspect(record.idempotency_key)
        assert key is not None and key["state"] == "claimed"  # not failed yet: nothing for the replay to reopen
        # When it is replayed then, and the worker goes on to write the key failed
        ((_, task_id),) = replay_dead_letters([record.pk]).replayed
    with pytest.raises(Exception, match="card refused"):
        first.get(timeout=TIMEOUT)
    # Then the replay reopens the key its original failed, runs, and the provider saw one charge
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"charged {oid}"
    assert [item["run"] for item in sink.items()] == [1, 2] and int(sink.client.get(f"{sink.key}:effects")) == 1
    assert get_store(celery_app).inspect(record.idempotency_key)["state"] == "completed"


def test_a_replay_of_a_message_published_with_dedupe_on_publish_is_published_and_runs(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    # Given a dead letter of a message published with dedupe_on_publish (its key's publish is remembered for an
    # hour, and the per-call option travels in its header)
    first = tasks.charge.apply_async((oid, sink.key, ["permanent", "ok"]), dedupe_on_publish=True)
    with pytest.raises(Exception, match="card refused"):
        first.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=first.id)
    # When it is replayed within that hour
    ((_, task_id),) = replay_dead_letters([record.pk]).replayed
    # Then the replay is published under its own task id (not taken for a duplicate of the first publish), runs,
    # and the provider saw one charge
    assert task_id != first.id
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"charged {oid}"
    assert int(sink.client.get(f"{sink.key}:effects")) == 1


@pytest.mark.parametrize("celery_worker_pool", ["threads"], indirect=True)
@pytest.mark.parametrize("celery_worker_parameters", [{"concurrency": 2}], indirect=True)
def test_a_replayed_scheduled_run_waits_for_the_run_of_its_schedule_that_is_going_instead_of_being_skipped(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a scheduled run of one period (an entry on the default policy: overlap=skip) that failed for good
    schedule, period = f"nightly-{uuid.uuid4().hex[:8]}", int(time.time()) // 60 * 60

    def of(due: int) -> dict[str, Any]:
        return {"guardrails": {"sched": schedule, "period": due}}

    first = tasks.charge.apply_async((oid, sink.key, ["permanent", "ok"]), headers=of(period - 3600))
    with pytest.raises(Exception, match="card refused"):
        first.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=first.id)
    # And the next period's run of the same schedule going on, held at a gate
    gate = f"{sink.key}:gate"
    running = tasks.scheduled_job.apply_async((sink.key,), {"gate": gate}, headers=of(period))
    store = get_store(celery_app)
    wait_for("the next period's run holds the schedule", lambda: store.inspect(slot_key(schedule)))
    # When the failed period is replayed meanwhile
    caplog.set_level("INFO")
    ((_, task_id),) = replay_dead_letters([record.pk]).replayed
    # Then the replay is put off behind the run that is going, not skipped as an overlap
    wait_for("the replay put off", lambda: "a replay waits for it" in caplog.text)
    assert "skipped" not in caplog.text
    # And once that run ends, the replay runs: the card is charged once
    sink.client.rpush(gate, "go")
    assert running.get(timeout=TIMEOUT)["period"] == period
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"charged {oid}"
    assert int(sink.client.get(f"{sink.key}:effects")) == 1


def test_replay_refused_without_permission_and_for_unknown_tasks(celery_worker: Any, sink: Sink, oid: int) -> None:
    record = dead_letter(sink, oid)
    with pytest.raises(PermissionDenied):
        replay_dead_letters([record.pk], user=staff_user())
    DeadLetter.objects.filter(pk=record.pk).update(task_name="tests.proj.tasks.gone")
    result = replay_dead_letters([record.pk])
    assert result.skipped == [
        (
            record.pk,
            "task 'tests.proj.tasks.gone' is not registered in this process (not found by autodiscover_tasks, "
            "CELERY_IMPORTS or include); the record stays open",
        )
    ]
    assert DeadLetter.objects.get(pk=record.pk).status == "open"


def test_admin_replay_needs_permission_confirms_logs_and_reports(celery_worker: Any, sink: Sink, oid: int) -> None:
    record = dead_letter(sink, oid)
    url = reverse("admin:guardrails_deadletter_replay", args=[record.pk])
    client = Client()
    # without the permission: 403
    client.force_login(staff_user())
    assert client.get(url).status_code == 403
    # with it: a confirmation page, then the replay, a LogEntry and a message
    user = staff_user("replay_deadletter")
    client.force_login(user)
    page = client.get(url)
    assert page.status_code == 200 and b"Are you sure you want to replay" in page.content
    done = client.post(url, {"post": "yes"}, follow=True)
    assert b"Replayed 1 dead letter(s)." in done.content
    record.refresh_from_db()
    assert record.status == "replayed" and record.handled_by == user.username
    (entry,) = LogEntry.objects.filter(object_id=str(record.pk))
    assert entry.change_message == f"Replayed as task {record.replayed_task_id}"


def test_admin_discard_action_confirms_first(celery_worker: Any, sink: Sink, oid: int) -> None:
    record = dead_letter(sink, oid)
    client = Client()
    client.force_login(staff_user("discard_deadletter"))
    changelist = reverse("admin:guardrails_deadletter_changelist")
    listing = client.get(changelist, {"reason": "permanent", "status": "open"})
    assert listing.status_code == 200 and record.task_id.encode() in listing.content
    form = {"action": "discard_selected", "_selected_action": [record.pk]}
    confirm = client.post(changelist, form)
    assert b"Are you sure you want to discard" in confirm.content
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    client.post(changelist, {**form, "post": "yes"})
    assert DeadLetter.objects.get(pk=record.pk).status == "discarded"
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk]))
    assert b"attempt-history" in detail.content and b"card refused" in detail.content


def test_replay_command(celery_worker: Any, sink: Sink, oid: int) -> None:
    record = dead_letter(sink, oid)
    out = StringIO()
    call_command("guardrails_replay", "--reason", "permanent", "--since", "1h", "--dry-run", stdout=out)
    assert f"would replay {record.pk}: tests.proj.tasks.charge[{record.task_id}] permanent" in out.getvalue()
    out = StringIO()
    call_command("guardrails_replay", "--task", "tests.proj.tasks.charge", "--since", "1h", stdout=out)
    assert "Replayed 1 dead letter(s); refused 0." in out.getvalue()
    assert DeadLetter.objects.get(pk=record.pk).status == "replayed"


def test_the_change_list_does_not_count_a_big_table(celery_worker: Any) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    if connection.vendor != "postgresql":
        pytest.skip("the planner's estimate is PostgreSQL's (runs in the PostgreSQL pass)")
    now = timezone.now()
    DeadLetter.objects.bulk_create(
        DeadLetter(task_name="t", task_id=f"big-{i}", reason="permanent", first_failed_at=now, last_failed_at=now)
        for i in range(12_000)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE guardrails_deadletter")
    client = Client()
    client.force_login(User.objects.create_superuser("big", "big@example.com", "pw"))
    with CaptureQueriesContext(connection) as queries:
        page = client.get(reverse("admin:guardrails_deadletter_changelist"))
    assert page.status_code == 200
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts == [], counts


def test_a_replay_whose_store_is_out_of_reach_leaves_the_record_open(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    from tests.support.proxy import TcpProxy
    from tests.support.services import REDIS_URL

    # Given a dead letter with an idempotency key, and a store (where the key is reopened) out of reach
    record = dead_letter(sink, oid)
    proxy = TcpProxy(6379)
    try:
        store = REDIS_URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
        app = type(celery_app)("replay-cut", set_as_current=False)
        app.conf.update(broker_url=celery_app.conf.broker_url, task_default_queue=celery_app.conf.task_default_queue)
        app.conf.guardrails = {**celery_app.conf.guardrails, "store": store}
        app.tasks.register(tasks.charge)  # the task, published through this app
        proxy.cut()
        # When it is replayed
        result = replay_dead_letters([record.pk], app=app)
        # Then nothing is published and the record is open again, saying why
        assert result.replayed == [] and "publishing failed" in result.skipped[0][1]
        assert DeadLetter.objects.get(pk=record.pk).status == "open"
        # And once the store is back, the replay goes through
        proxy.restore()
        assert len(replay_dead_letters([record.pk], app=app).replayed) == 1
    finally:
        proxy.close()


def test_an_action_on_one_selected_row_of_four_changes_that_row_only(celery_worker: Any, sink: Sink, oid: int) -> None:
    # Given four open dead letters
    records = [dead_letter(Sink.of(f"{sink.key}:{i}"), oid + i) for i in range(4)]
    client = Client()
    client.force_login(staff_user("discard_deadletter"))
    changelist = reverse("admin:guardrails_deadletter_changelist")
    # When one row is ticked and discarded, as the change list posts it (select_across is "0")
    form = {"action": "discard_selected", "_selected_action": [records[1].pk], "select_across": "0", "index": "0"}
    confirm = client.post(changelist, form)
    assert b"(1 record)" in confirm.content and b'name="select_across" value="0"' in confirm.content
    client.post(changelist, {**form, "post": "yes"})
    # Then that record only is discarded
    statuses = {r.pk: r.status for r in DeadLetter.objects.filter(pk__in=[r.pk for r in records])}
    assert statuses == {r.pk: "discarded" if r is records[1] else "open" for r in records}
    # And with "select all" chosen, every record the filter shows
    every = {**form, "select_across": "1", "_selected_action": [records[0].pk]}
    client.post(f"{changelist}?status=open", {**every, "post": "yes"})
    assert set(DeadLetter.objects.filter(pk__in=[r.pk for r in records]).values_list("status", flat=True)) == {
        "discarded"
    }


def test_the_overview_counts_open_records_and_the_last_day_and_a_replay_links_its_outcome(
    celery_worker: Any, sink: Sink, oid: int
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    # Given three real open dead letters of one task, one of them owned by payments, and an older one
    records = [dead_letter(Sink.of(f"{sink.key}:{i}"), oid + i) for i in range(3)]
    DeadLetter.objects.filter(pk=records[0].pk).update(owner="payments")
    moment = timezone.now() - timedelta(days=3)
    DeadLetter.objects.create(
        task_name="t.old", task_id=f"old-{oid}", reason="poison", first_failed_at=moment, last_failed_at=moment
    )
    client = Client()
    client.force_login(staff_user("replay_deadletter"))
    # When the overview is opened from the change list
    listing = client.get(reverse("admin:guardrails_deadletter_changelist"))
    assert b"overview-link" in listing.content
    page = client.get(reverse("admin:guardrails_deadletter_overview"))
    # Then it counts the open ones by reason, owner and task, and the last 24 hours hour by hour
    assert page.status_code == 200
    overview = page.context["overview"]
    assert overview.open_count == 4 and overview.last_day_count == 3
    assert [(g.value, g.count) for g in overview.by_reason] == [("permanent", 3), ("poison", 1)]
    assert [(g.value, g.count) for g in overview.by_task] == [("tests.proj.tasks.charge", 3), ("t.old", 1)]
    assert ("payments", 1) in [(g.value, g.count) for g in overview.by_owner]
    assert len(overview.hours) == 24 and overview.hours[-1].count == 3
    # When one record is replayed (the charge script says it succeeds on its second run)
    ((_, task_id),) = replay_dead_letters([records[1].pk]).replayed
    tasks.charge.AsyncResult(task_id).get(timeout=TIMEOUT)
    # Then its page shows the replay's task id and its state
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[records[1].pk]))
    assert f'{task_id} <span class="replay-state">(SUCCESS)</span>'.encode() in detail.content


def test_many_refusals_are_one_message_and_internal_tables_are_read_only(
    celery_worker: Any, sink: Sink, oid: int
) -> None:
    from django_celery_guardrails.models import DependencyState, IdempotencyKey

    # Given three open records of a task that is not registered
    records = [dead_letter(Sink.of(f"{sink.key}:{i}"), oid + i) for i in range(3)]
    DeadLetter.objects.filter(pk__in=[r.pk for r in records]).update(task_name="tests.proj.tasks.gone")
    client = Client()
    client.force_login(User.objects.create_superuser(f"root{oid}", "root@example.com", "pw"))
    changelist = reverse("admin:guardrails_deadletter_changelist")
    # When all three are replayed from the change list
    form = {"action": "replay_selected", "_selected_action": [r.pk for r in records], "post": "yes"}
    done = client.post(changelist, form, follow=True)
    # Then one message names the three and the reason, once
    texts = [str(m) for m in done.context["messages"]]
    ids = ", ".join(str(r.pk) for r in records)
    assert texts == [
        f"3 dead letter(s) not replayed ({ids}): task 'tests.proj.tasks.gone' is not registered in this process (not "
        "found by autodiscover_tasks, CELERY_IMPORTS or include); the record stays open"
    ]
    # And the internal tables offer no Add, the key list hides the guardrails' own keys
    IdempotencyKey.objects.create(key="guardrails:watchdog:abc", state="claimed")
    IdempotencyKey.objects.create(key=f"tests.proj.tasks.charge:-:charge:{oid}", state="completed")
    DependencyState.objects.create(dependency="payments-api")
    keys = client.get(reverse("admin:guardrails_idempotencykey_changelist"))
    shown = {row.key for row in keys.context["cl"].result_list}
    assert "guardrails:watchdog:abc" not in shown and f"tests.proj.tasks.charge:-:charge:{oid}" in shown
    for model in ("idempotencykey", "dependencystate", "deadletter"):
        assert client.get(reverse(f"admin:guardrails_{model}_add")).status_code == 403
    row = DependencyState.objects.get(dependency="payments-api")
    page = client.get(reverse("admin:guardrails_dependencystate_change", args=[row.pk]))
    assert page.status_code == 200 and b'name="_save"' not in page.content


def open_letters(count: int, *, keyed: int = 0) -> list[DeadLetter]:
    """``count`` open records of a registered task (recorded as a worker would, without running one each); the
    first ``keyed`` of them with an idempotency key."""
    from django.utils import timezone

    now = timezone.now()
    run = uuid.uuid4().hex[:8]
    return DeadLetter.objects.bulk_create(
        DeadLetter(
            task_name="tests.proj.tasks.charge",
            task_id=f"many-{run}-{n}",
            args=[n, f"sink-{run}", ["ok"]],
            header={"tenant": "acme", "cid": f"req-{run}"},
            tenant="acme",
            reason="circuit_open",
            idempotency_key=f"tests.proj.tasks.charge:acme:charge:{run}-{n}" if n < keyed else "",
            first_failed_at=now,
            last_failed_at=now,
        )
        for n in range(count)
    )


def test_a_replay_of_many_records_goes_in_batches_reports_progress_and_publishes_each_once(
    celery_app: Any, broker: str, queue_name: str
) -> None:
    from celery_guardrails.stores import get_store
    from tests.conftest import waiting_messages

    # Given 1,203 open dead letters, three of them with a key that failed with its message
    records = open_letters(1203, keyed=3)
    store = get_store(celery_app)
    for record in records[:3]:
        store.claim(record.idempotency_key, owner="w", now=1.0, lease=60, retention=3600)
        store.fail(record.idempotency_key, owner="w", now=2.0, reason="card refused", retention=3600)
    # When they are replayed, with a progress callback
    seen: list[tuple[int, int]] = []
    result = replay_dead_letters([r.pk for r in records], progress=lambda done, total: seen.append((done, total)))
    # Then progress is reported after each batch of 500
    assert seen == [(500, 1203), (1000, 1203), (1203, 1203)]
    # And each record is replayed once, as the task id it now holds, and published once
    assert sorted(pk for pk, _ in result.replayed) == sorted(r.pk for r in records) and result.skipped == []
    held = dict(DeadLetter.objects.filter(pk__in=[r.pk for r in records]).values_list("pk", "replayed_task_id"))
    assert held == dict(result.replayed)
    assert waiting_messages(broker, queue_name) == 1203
    # And the failed keys were reopened for the replays
    assert [store.inspect(r.idempotency_key) for r in records[:3]] == [None, None, None]
    # When they are replayed again
    again = replay_dead_letters([r.pk for r in records])
    # Then nothing more is published
    assert again.replayed == [] and {why for _, why in again.skipped} == {"status is replayed"}
    assert waiting_messages(broker, queue_name) == 1203


#: kombu batches a producer's publishes (5.7 on): a replay's batch goes to a Redis broker as one pipeline.
BATCHES = hasattr(Producer, "batch")


@contextmanager
def on_publish(handle: Any) -> Iterator[None]:
    """``handle(task_id)`` called as Celery is about to publish each message (its ``before_task_publish``)."""

    def handler(headers: dict[str, Any] | None = None, **_: Any) -> None:
        handle((headers or {}).get("id"))

    before_task_publish.connect(handler, weak=False)
    try:
        yield
    finally:
        before_task_publish.disconnect(handler)


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_a_batch_goes_to_a_redis_broker_in_one_pipeline_once_every_record_is_claimed(
    celery_app: Any, broker: str, queue_name: str
) -> None:
    from amqp.exceptions import NotFound

    from tests.conftest import waiting_messages

    def queued() -> int:
        try:
            return waiting_messages(broker, queue_name)
        except NotFound:  # RabbitMQ: the queue is declared with its first message
            return 0

    # Given 7 open dead letters
    records = open_letters(7)
    # When they are replayed, the queue looked at as each message is about to be published
    seen: list[tuple[int, int]] = []
    claimed = DeadLetter.objects.filter(pk__in=[r.pk for r in records], status="replayed")
    with on_publish(lambda _: seen.append((queued(), claimed.count()))):
        result = replay_dead_letters([r.pk for r in records])
    # Then every record was claimed before the first message went out
    assert [held for _, held in seen] == [7] * 7
    # And on Redis none of the batch is on the broker until its last message is in the pipeline (kombu's
    # Producer.batch); RabbitMQ takes each as it is published (kombu has no batch for it)
    if broker == "redis":
        assert [queued for queued, _ in seen] == ([0] * 7 if BATCHES else list(range(7)))
    # And then all 7 are there, each replayed once
    assert len(result.replayed) == 7 and result.skipped == []
    wait_for("the 7 replays on the broker", lambda: queued() == 7, timeout=TIMEOUT)


def test_a_pipeline_the_broker_did_not_take_puts_its_whole_batch_back_to_open(celery_app: Any, queue_name: str) -> None:
    from tests.conftest import waiting_messages
    from tests.support.proxy import TcpProxy

    if not BATCHES:
        pytest.skip("kombu before 5.7 publishes one message at a time: no pipeline to cut")
    # Given 5 open dead letters, and an app whose broker (Redis) is reached through a proxy
    records = open_letters(5)
    ids = [r.pk for r in records]
    proxy = TcpProxy(6379)
    app = type(celery_app)("replay-pipeline-cut", set_as_current=False)
    try:
        app.conf.update(
            broker_url=celery_app.conf.broker_url.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}"),
            task_default_queue=queue_name,
            broker_connection_retry=False,
        )
        app.conf.guardrails = celery_app.conf.guardrails
        app.tasks.register(tasks.charge)
        # When the broker goes away as the batch's last message is published (before the pipeline is sent)
        last = len(ids)
        published: list[str] = []

        def cut_at_the_last(task_id: str) -> None:
            published.append(task_id)
            if len(published) == last:
                proxy.cut()

        with on_publish(cut_at_the_last):
            result = replay_dead_letters(ids, app=app)
        # Then no record says replayed: the 5 are open again, each saying why, and none is on the broker
        assert result.replayed == [] and sorted(pk for pk, _ in result.skipped) == ids
        assert {why.split(":")[0] for _, why in result.skipped} == {"publishing failed"}
        assert list(DeadLetter.objects.filter(pk__in=ids).values_list("status", flat=True)) == ["open"] * 5
        assert waiting_messages("redis", queue_name) == 0
        # And once the broker is back, the replay publishes each once
        proxy.restore()
        again = replay_dead_letters(ids, app=app)
        assert len(again.replayed) == 5 and waiting_messages("redis", queue_name) == 5
    finally:
        app.close()
        proxy.close()


@pytest.mark.parametrize("one_statement", [True, False], ids=["update-returning", "update-then-read"])
def test_a_batch_claim_wins_only_the_records_still_open_each_with_its_own_task_id(
    monkeypatch: pytest.MonkeyPatch, one_statement: bool
) -> None:
    from django_celery_guardrails import replay, replay_claims

    # Given four open records, planned for a replay, each given its new task id
    monkeypatch.setattr(replay_claims, "claims_in_one_statement", lambda: one_statement)
    records = open_letters(4)
    planned = [replay._Claimed(record, replay.plan(record), f"new-{record.pk}") for record in records]
    # And another replay that moved the second one first
    DeadLetter.objects.filter(pk=records[1].pk).update(status="replayed", replayed_task_id="someone-else")
    # When this replay claims the batch
    user = User.objects.create_user(f"u{uuid.uuid4().hex[:8]}")
    won = replay._claim(planned, user)
    # Then it wins the three still open, and each holds its own new task id, with who and when
    assert [item.record.pk for item in won] == [records[0].pk, records[2].pk, records[3].pk]
    rows = DeadLetter.objects.filter(pk__in=[r.pk for r in records]).order_by("pk")
    assert [(row.status, row.replayed_task_id) for row in rows] == [
        ("replayed", f"new-{records[0].pk}"),
        ("replayed", "someone-else"),
        ("replayed", f"new-{records[2].pk}"),
        ("replayed", f"new-{records[3].pk}"),
    ]
    assert {row.handled_by for row in rows if row.pk != records[1].pk} == {user.username}
    assert all(row.handled_at is not None for row in rows if row.pk != records[1].pk)
    # And a second replay of the same batch (its own new task ids) wins nothing
    again = [replay._Claimed(item.record, item.message, f"again-{item.record.pk}") for item in planned]
    assert replay._claim(again, user) == []


def test_the_command_prints_progress_and_the_admin_logs_many_replays_in_few_inserts(
    celery_app: Any, broker: str, queue_name: str
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    # Given 600 open circuit_open records
    first = open_letters(600)
    # When the command replays them (its output is not a terminal)
    out = StringIO()
    call_command("guardrails_replay", "--reason", "circuit_open", stdout=out)
    # Then it prints a line a batch, then the summary
    assert out.getvalue().splitlines() == [
        f"[{'#' * 16:<20}] 500/600",
        f"[{'#' * 20}] 600/600",
        "Replayed 600 dead letter(s); refused 0.",
    ]
    assert set(DeadLetter.objects.filter(pk__in=[r.pk for r in first]).values_list("status", flat=True)) == {"replayed"}
    # Given 600 more, when "select all" of the filtered change list replays them
    more = open_letters(600)
    client = Client()
    client.force_login(User.objects.create_superuser(f"many{uuid.uuid4().hex[:6]}", "m@example.com", "pw"))
    changelist = reverse("admin:guardrails_deadletter_changelist")
    form = {"action": "replay_selected", "select_across": "1", "index": "0", "_selected_action": [more[0].pk]}
    with CaptureQueriesContext(connection) as queries:
        done = client.post(f"{changelist}?status=open&reason=circuit_open", {**form, "post": "yes"}, follow=True)
    # Then each record has its LogEntry, written 500 an INSERT, and one message says how many
    assert [str(m) for m in done.context["messages"]] == ["Replayed 600 dead letter(s)."]
    entries = dict(
        LogEntry.objects.filter(object_id__in=[str(r.pk) for r in more]).values_list("object_id", "change_message")
    )
    held = DeadLetter.objects.filter(pk__in=[r.pk for r in more]).values_list("pk", "replayed_task_id")
    assert entries == {str(pk): f"Replayed as task {task_id}" for pk, task_id in held}
    inserts = [q for q in queries.captured_queries if q["sql"].startswith('INSERT INTO "django_admin_log"')]
    assert len(inserts) == (2 if connection.vendor == "postgresql" else 5)  # SQLite: 999 parameters an INSERT


# not_idempotent records: a task that failed after it may already have acted is replayed only on a person's word.

#: A note in the last attempt record of a not_idempotent failure, as a test writes it (the core's own is longer).
NOTE = "mark the effect with effect(), hand self.request.idempotency_key downstream, or declare idempotent=True"


def not_idempotent_letter(sink: Sink, *, note: str = "") -> DeadLetter:
    """A real not_idempotent dead letter, for tenant acme: behave_not_idempotent's first run fails with an error
    nobody classified, after it may have acted, so it is not retried; its next run (a replay) succeeds.
    ``note``: what its last attempt record says (the core writes its own advice there; "": a record written
    before notes existed, with none)."""
    with tenant_context("acme"):
        result = tasks.behave_not_idempotent.delay(sink.key, ["unknown", "ok"])
    with pytest.raises(RuntimeError, match="nobody knows"):
        result.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=result.id)
    assert record.reason == NOT_IDEMPOTENT and len(sink.items()) == 1
    assert "marks no effect" in record.history[-1]["note"]  # the core's advice
    last = {k: v for k, v in record.history[-1].items() if k != "note"}
    record.history = [*record.history[:-1], {**last, "note": note} if note else last]
    DeadLetter.objects.filter(pk=record.pk).update(history=record.history)
    return record


@contextmanager
def published() -> Iterator[list[str]]:
    """The task ids this process publishes while the block runs (Celery's before_task_publish: a replay
    publishes from its caller's process, so a refusal that published anyway would show here at once)."""
    ids: list[str] = []

    def seen(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        ids.append(str((headers or {}).get("id")))

    before_task_publish.connect(seen, weak=False, dispatch_uid="test-replay-published")
    try:
        yield ids
    finally:
        before_task_publish.disconnect(dispatch_uid="test-replay-published")


def test_a_not_idempotent_record_is_replayed_only_when_the_caller_allows_it(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given a task that failed after it may already have acted (it ran once)
    record = not_idempotent_letter(sink)
    # When it is replayed like any other record
    with published() as ids:
        result = replay_dead_letters([record.pk], user=staff_user("replay_deadletter"))
    # Then nothing is published, the record stays open, and the result says why and how to replay it anyway
    assert ids == [] and result.replayed == []
    assert result.skipped == [(record.pk, NOT_IDEMPOTENT_REFUSAL)]
    assert NOT_IDEMPOTENT_REFUSAL.startswith("not_idempotent: it may already have acted")
    assert "allow_not_idempotent=True" in NOT_IDEMPOTENT_REFUSAL and "--allow-not-idempotent" in NOT_IDEMPOTENT_REFUSAL
    record.refresh_from_db()
    assert (record.status, record.replayed_task_id, record.handled_by) == ("open", "", "")
    # And a dry run asks the same question and gets the same answer
    with pytest.raises(Refused) as refused:
        plan(record)
    assert str(refused.value) == NOT_IDEMPOTENT_REFUSAL
    assert [(r.pk, why) for r, why in refusals([record.pk])] == [(record.pk, NOT_IDEMPOTENT_REFUSAL)]
    assert [why for _, why in refusals([record.pk], allow_not_idempotent=True)] == [""]
    # When the caller says they checked the effect did not happen
    with published() as ids:
        result = replay_dead_letters([record.pk], user=staff_user("replay_deadletter"), allow_not_idempotent=True)
    # Then it is published once and a real worker runs it again, as its tenant
    ((replayed_pk, task_id),) = result.replayed
    assert (replayed_pk, ids, result.skipped) == (record.pk, [task_id], [])
    again = celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)
    assert (again["run"], again["step"], again["tenant"]) == (2, "ok", "acme")
    assert len(sink.items()) == 2
    record.refresh_from_db()
    assert (record.status, record.replayed_task_id) == ("replayed", task_id)


def test_edit_and_replay_of_a_not_idempotent_record_needs_the_same_word(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given a not_idempotent record
    record = not_idempotent_letter(sink)
    # When it is replayed with a fix (another tenant): new values do not undo what the failed run may have done
    with published() as ids:
        result = replay_with_changes(record.pk, tenant="globex")
    # Then it is refused the same way, and stays open
    assert (ids, result.replayed, result.skipped) == ([], [], [(record.pk, NOT_IDEMPOTENT_REFUSAL)])
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    # When the caller allows it, Then the fix is replayed and the worker runs it as the new tenant
    ((_, task_id),) = replay_with_changes(record.pk, tenant="globex", allow_not_idempotent=True).replayed
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)["tenant"] == "globex"


def test_the_command_refuses_not_idempotent_records_without_the_flag(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    # Given a not_idempotent record and a permanent one
    unsafe = not_idempotent_letter(Sink.of(f"{sink.key}:unsafe"))
    permanent = dead_letter(sink, oid)
    only = ["--task", tasks.behave_not_idempotent.name]
    # When a dry run is asked without the flag
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match=r"^1 dead letter\(s\) would be refused"):
        call_command("guardrails_replay", *only, "--dry-run", stdout=out, stderr=err)
    # Then it says it would refuse the record, why, and how to replay it anyway
    assert err.getvalue() == (
        f"would refuse {unsafe.pk}: {unsafe.task_name}[{unsafe.task_id}]: {NOT_IDEMPOTENT_REFUSAL}\n"
    )
    assert out.getvalue() == "0 dead letter(s) would be replayed, 1 refused.\n"
    # And with the flag it would replay it
    out = StringIO()
    call_command("guardrails_replay", *only, "--dry-run", "--allow-not-idempotent", stdout=out)
    assert f"would replay {unsafe.pk}: {unsafe.task_name}[{unsafe.task_id}] not_idempotent" in out.getvalue()
    # When everything open is replayed without the flag
    out, err = StringIO(), StringIO()
    with published() as ids, pytest.raises(CommandError, match=r"^1 dead letter\(s\) refused"):
        call_command("guardrails_replay", "--since", "1h", stdout=out, stderr=err)
    # Then the permanent record is replayed, the not_idempotent one refused, named on stderr, and left open
    assert err.getvalue() == f"refused {unsafe.pk}: {NOT_IDEMPOTENT_REFUSAL}\n"
    assert out.getvalue().splitlines()[-1] == "Replayed 1 dead letter(s); refused 1."
    statuses = dict(DeadLetter.objects.filter(pk__in=[unsafe.pk, permanent.pk]).values_list("pk", "status"))
    assert statuses == {unsafe.pk: "open", permanent.pk: "replayed"}
    assert ids == [DeadLetter.objects.get(pk=permanent.pk).replayed_task_id]
    # When it is replayed with the flag
    out = StringIO()
    call_command("guardrails_replay", *only, "--allow-not-idempotent", stdout=out)
    # Then it is replayed, and a worker runs it again
    assert out.getvalue().splitlines()[-1] == "Replayed 1 dead letter(s); refused 0."
    unsafe.refresh_from_db()
    assert unsafe.status == "replayed"
    assert celery_app.AsyncResult(unsafe.replayed_task_id).get(timeout=TIMEOUT)["run"] == 2


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_the_replay_action_warns_of_not_idempotent_records_and_replays_them_only_when_ticked(
    celery_worker: Any, celery_app: Any, sink: Sink, oid: int
) -> None:
    # Given a not_idempotent record whose last attempt carries the core's note, and a permanent one
    unsafe = not_idempotent_letter(Sink.of(f"{sink.key}:unsafe"), note=NOTE)
    permanent = dead_letter(sink, oid)
    user = staff_user("replay_deadletter")
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:guardrails_deadletter_changelist")
    form = {"action": "replay_selected", "_selected_action": [unsafe.pk, permanent.pk], "select_across": "0"}
    # When both are ticked and the replay action chosen
    confirm = client.post(changelist, form)
    # Then the confirmation page warns of the not_idempotent one, names it with its note, and asks for a tick
    page = confirm.content.decode()
    assert confirm.status_code == 200 and "Are you sure you want to replay" in page
    start = page.index('id="not-idempotent"')
    warning = page[start : page.index("</form>", start)]  # (the header's log-out form closes earlier)
    assert "1 of these records failed as <code>not_idempotent</code>" in warning
    assert "may already have acted" in warning and "may repeat that effect" in warning
    assert f'{unsafe.task_name}[{unsafe.task_id}] (tenant acme): <span class="note">{NOTE}</span>' in warning
    assert permanent.task_id not in warning
    box = '<input type="checkbox" name="allow_not_idempotent" value="yes" id="allow-not-idempotent">'
    assert box in warning  # unticked, inside the form it posts with
    assert "I checked that the effect did not happen; replay these anyway" in warning
    # When it is confirmed without the tick
    done = client.post(changelist, {**form, "post": "yes"}, follow=True)
    # Then the permanent record is replayed, the other reported not replayed with the reason, and left open
    assert messages_of(done) == [
        "Replayed 1 dead letter(s).",
        f"1 dead letter(s) not replayed ({unsafe.pk}): {NOT_IDEMPOTENT_REFUSAL}",
    ]
    statuses = dict(DeadLetter.objects.filter(pk__in=[unsafe.pk, permanent.pk]).values_list("pk", "status"))
    assert statuses == {unsafe.pk: "open", permanent.pk: "replayed"}
    assert list(LogEntry.objects.filter(object_id=str(unsafe.pk))) == []
    # And a selection without not_idempotent records shows no warning and no box
    other = dead_letter(Sink.of(f"{sink.key}:other"), oid + 1)
    plain = client.post(changelist, {**form, "_selected_action": [other.pk]})
    assert b"not-idempotent" not in plain.content and b"allow_not_idempotent" not in plain.content
    # When it is confirmed with the tick
    done = client.post(
        changelist, {**form, "_selected_action": [unsafe.pk], "post": "yes", "allow_not_idempotent": "yes"}
    )
    assert done.status_code == 302
    # Then it is replayed, a worker runs it again, and its LogEntry says whose word let it run
    unsafe.refresh_from_db()
    assert (unsafe.status, unsafe.handled_by) == ("replayed", user.username)
    assert celery_app.AsyncResult(unsafe.replayed_task_id).get(timeout=TIMEOUT)["run"] == 2
    (entry,) = LogEntry.objects.filter(object_id=str(unsafe.pk))
    assert entry.change_message == (
        f"Replayed as task {unsafe.replayed_task_id}; not_idempotent: replayed on the user's word that the effect "
        "did not happen"
    )
    (entry,) = LogEntry.objects.filter(object_id=str(permanent.pk))
    assert entry.change_message == f"Replayed as task {DeadLetter.objects.get(pk=permanent.pk).replayed_task_id}"
    # And the record's page shows the note in its attempt history
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[unsafe.pk])).content.decode()
    table = detail[detail.index('<table class="attempt-history">') :]
    table = table[: table.index("</table>")]
    assert "<th>note</th>" in table and f'<td class="note">{NOTE}</td>' in table


def test_the_one_record_pages_of_a_not_idempotent_record_ask_for_the_tick(
    celery_worker: Any, celery_app: Any, sink: Sink
) -> None:
    # Given a not_idempotent record with the core's note, and one without (recorded before notes existed)
    unsafe = not_idempotent_letter(Sink.of(f"{sink.key}:unsafe"), note=NOTE)
    older = not_idempotent_letter(Sink.of(f"{sink.key}:older"))
    client = Client()
    client.force_login(staff_user("replay_deadletter"))
    replay = reverse("admin:guardrails_deadletter_replay", args=[unsafe.pk])
    # When its Replay page is opened
    page = client.get(replay).content.decode()
    # Then it warns, names it with its note, has the unticked box, and no other refusal
    assert "This record failed as <code>not_idempotent</code>" in page and NOTE in page
    assert 'name="allow_not_idempotent" value="yes" id="allow-not-idempotent">' in page
    assert "As it is, this record would not be replayed" not in page
    # When it is confirmed without the tick: Then it is not replayed, saying why
    done = client.post(replay, {"post": "yes"}, follow=True)
    assert messages_of(done) == [f"1 dead letter(s) not replayed ({unsafe.pk}): {NOT_IDEMPOTENT_REFUSAL}"]
    assert DeadLetter.objects.get(pk=unsafe.pk).status == "open"
    # When its Edit and replay page is opened: Then it warns, with the note, and the form has the unticked box
    edit = reverse("admin:guardrails_deadletter_edit_and_replay", args=[unsafe.pk])
    form = client.get(edit)
    assert b'id="not-idempotent"' in form.content and NOTE.encode() in form.content
    assert form.context["form"]["allow_not_idempotent"].value() is False
    assert b"Unchanged, it would not be replayed" not in form.content
    # When the fix is sent without the tick: Then nothing is replayed, the form is shown again with the reason
    values = {"tenant": "globex", "args": json.dumps(unsafe.args), "kwargs": json.dumps(unsafe.kwargs)}
    again = client.post(edit, values)
    assert again.status_code == 200 and messages_of(again) == [
        f"1 dead letter(s) not replayed ({unsafe.pk}): {NOT_IDEMPOTENT_REFUSAL}"
    ]
    assert DeadLetter.objects.get(pk=unsafe.pk).status == "open"
    # When it is sent with the tick: Then it is replayed as the new tenant, and the LogEntry says both
    done = client.post(edit, {**values, "allow_not_idempotent": "on"}, follow=True)
    assert messages_of(done) == ["Replayed 1 dead letter(s)."]
    unsafe.refresh_from_db()
    assert celery_app.AsyncResult(unsafe.replayed_task_id).get(timeout=TIMEOUT)["tenant"] == "globex"
    (entry,) = LogEntry.objects.filter(object_id=str(unsafe.pk))
    assert entry.change_message == (
        f"Replayed as task {unsafe.replayed_task_id}; changed tenant 'acme' -> 'globex'; not_idempotent: replayed "
        "on the user's word that the effect did not happen"
    )
    # And a record without a note still warns and asks for the tick; its history's note cells are empty
    page = client.get(reverse("admin:guardrails_deadletter_replay", args=[older.pk])).content.decode()
    assert "This record failed as <code>not_idempotent</code>" in page and 'id="allow-not-idempotent"' in page
    assert 'class="note"' not in page
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[older.pk])).content.decode()
    assert '<td class="note"></td>' in detail
    # And its Replay page, with the tick, replays it
    client.post(
        reverse("admin:guardrails_deadletter_replay", args=[older.pk]), {"post": "yes", "allow_not_idempotent": "yes"}
    )
    assert DeadLetter.objects.get(pk=older.pk).status == "replayed"


def test_the_edit_form_takes_empty_arguments_and_refuses_a_blank_field() -> None:
    from django_celery_guardrails.forms import EditAndReplayForm

    # Given a task without keyword arguments (or positional ones): [] and {} are values, not missing ones
    assert EditAndReplayForm({"tenant": "", "args": "[]", "kwargs": "{}"}).is_valid()
    # But a field left blank is refused, saying what to give
    blank = EditAndReplayForm({"tenant": "", "args": "", "kwargs": ""})
    assert not blank.is_valid() and blank.errors == {
        "args": ['Give a JSON list, such as [42, "EUR"], or [] for none.'],
        "kwargs": ['Give a JSON object, such as {"amount": 10}, or {} for none.'],
    }
    # And the not_idempotent box is there, unticked, only for a not_idempotent record
    assert "allow_not_idempotent" not in EditAndReplayForm().fields
    assert EditAndReplayForm(not_idempotent=True).fields["allow_not_idempotent"].initial is False
