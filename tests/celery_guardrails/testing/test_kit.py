"""The test kit's helpers, each on a wrong handler (the helper must catch it) and its guarded twin (it must
pass), on a real worker, broker and database (tests/kit_proj)."""

from __future__ import annotations

import uuid

import pytest

from celery_guardrails.testing import (
    KitError,
    Release,
    assert_dead_lettered,
    assert_no_loss,
    assert_single_effect,
    crash_mid_task,
    deliver_twice,
    deploy_during_processing,
    out_of_order,
    poison,
    store_outage,
)
from tests.kit_proj import tasks
from tests.support.services import require
from tests.testapp.models import ChunkItem, Effect, Order

pytestmark = [pytest.mark.guardrails(app="tests.kit_proj.app:app", pool="prefork", concurrency=2)]


@pytest.fixture(autouse=True)
def _services() -> None:
    require("redis")


def key() -> str:
    return uuid.uuid4().hex[:12]


# -- deliver_twice ------------------------------------------------------------------------------------------


def test_deliver_twice_catches_a_non_idempotent_insert() -> None:
    # Given a plain task that inserts a row per delivery
    k = key()
    # When the same message is delivered twice
    report = deliver_twice(tasks.record_plain, k)
    # Then both deliveries ran, and the kit's assertion fails on the second row
    assert report.outcomes == [("succeeded", ""), ("succeeded", "")]
    with pytest.raises(AssertionError, match="happened 2 times, expected 1"):
        assert_single_effect(Effect.objects.filter(key=k))


@pytest.mark.smoke
def test_deliver_twice_passes_the_keyed_task() -> None:
    k = key()
    report = deliver_twice(tasks.record_guarded, k)
    assert report.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    assert_single_effect(Effect.objects.filter(key=k))


def test_deliver_twice_concurrently_catches_and_passes() -> None:
    # Given both copies held at the start until both are in, then let go together
    plain, guarded = key(), key()
    deliver_twice(tasks.record_plain, plain, concurrently=True)
    report = deliver_twice(tasks.record_guarded, guarded, concurrently=True)
    # Then the plain task wrote twice; the keyed one once (the copy that found the key held came back later)
    with pytest.raises(AssertionError, match="happened 2 times"):
        assert_single_effect(Effect.objects.filter(key=plain))
    assert_single_effect(Effect.objects.filter(key=guarded))
    # and the copies met: the second found the key held by the first, still in its body
    assert report.outcomes[0] == ("retry_later", "")
    assert sorted(o for o, _ in report.outcomes[1:]) == ["duplicate_skipped", "succeeded"]


# -- crash_mid_task -----------------------------------------------------------------------------------------


def test_crash_half_way_catches_a_job_that_commits_half_its_work() -> None:
    # Given a job of 10 items, each committed on its own, SIGKILLed after item 5
    job = key()
    report = crash_mid_task(tasks.items_plain, job, 10, at="half")
    # Then the redelivery wrote the first half again
    assert report.crashes == 1
    assert report.outcomes == [("succeeded", "")]
    with pytest.raises(AssertionError, match="happened 16 times, expected 10"):
        assert_single_effect(ChunkItem.objects.filter(job=job), expected=10)


@pytest.mark.smoke
def test_crash_half_way_passes_the_job_in_one_transaction_with_its_key() -> None:
    job = key()
    report = crash_mid_task(tasks.items_guarded, job, 10, at="half")
    assert report.crashes == 1
    assert report.of().starts == 2
    assert_single_effect(ChunkItem.objects.filter(job=job), expected=10)
    assert sorted(ChunkItem.objects.filter(job=job).values_list("item", flat=True)) == list(range(10))


def test_crash_half_way_catches_a_job_acked_before_it_ran() -> None:
    # Given Celery's default early ack: the broker forgets the message as it is delivered
    job = key()
    with pytest.raises(KitError, match="lost in the crash"):
        crash_mid_task(tasks.items_early_ack, job, 10, at="half")


def test_crash_after_the_body_before_the_ack() -> None:
    # Given the worker killed when the body has returned, before the ack (the classic duplicate)
    plain, guarded = key(), key()
    crash_mid_task(tasks.record_plain, plain, at="after_body")
    report = crash_mid_task(tasks.record_guarded, guarded, at="after_body")
    with pytest.raises(AssertionError, match="happened 2 times"):
        assert_single_effect(Effect.objects.filter(key=plain))
    assert_single_effect(Effect.objects.filter(key=guarded))
    assert report.outcomes == [("duplicate_skipped", "completed")]


def test_crash_some_seconds_into_the_body() -> None:
    # Given a job of 30 items, a tenth of a second each (3 s at least, however fast the machine)
    job = key()
    # When the worker is SIGKILLed half a second after the delivery started
    report = crash_mid_task(tasks.items_slow, job, 30, at=0.5)
    # Then the redelivery did the whole job once (the killed run's items rolled back with its transaction)
    assert report.crashes == 1
    assert report.deliveries == 2
    assert report.outcomes == [("succeeded", "")]
    assert_single_effect(ChunkItem.objects.filter(job=job), expected=30)


def test_a_crash_timed_after_the_task_ended_says_so() -> None:
    job = key()
    with pytest.raises(KitError, match="nothing was crashed"):
        crash_mid_task(tasks.items_guarded, job, 3, at=30.0)


def test_crash_at_a_point_never_reached_says_so() -> None:
    with pytest.raises(KitError, match="without reaching the point 'no-such-point'"):
        crash_mid_task(tasks.record_guarded, key(), at="no-such-point")


# -- poison -------------------------------------------------------------------------------------------------


def test_poison_catches_a_message_that_would_loop_for_ever() -> None:
    with pytest.raises(KitError, match="would loop for ever"):
        poison(tasks.crash_plain, key(), max_deliveries=3)


def test_poison_passes_the_guarded_task_which_dead_letters_it() -> None:
    k = key()
    report = poison(tasks.crash_guarded, k)
    # max_deliveries=2: the first delivery and two redeliveries kill the worker; the third is refused
    assert report.crashes == 3
    assert report.outcomes == [("dead_lettered", "poison")]
    assert_dead_lettered(report.task_id, reason="poison")
    assert_single_effect(Effect.objects.filter(key=k), expected=0)
    assert_no_loss(report.task_id)


def test_a_malformed_envelope_is_dead_lettered() -> None:
    report = poison(tasks.record_guarded, key(), how="malformed")
    assert_dead_lettered(report.task_id, reason="malformed_message")


# -- out_of_order -------------------------------------------------------------------------------------------


@pytest.mark.guardrails(pool="solo")  # one at a time: the plain task's result is then the delivery order's
@pytest.mark.parametrize(("task", "final"), [(tasks.status_plain, "placed"), (tasks.status_guarded, "delivered")])
def test_out_of_order_updates(task: object, final: str) -> None:
    # Given three updates made in order, delivered last first
    order = Order.objects.create()
    updates = [(order.pk, "placed"), (order.pk, "shipped"), (order.pk, "delivered")]
    report = out_of_order(task, updates)
    order.refresh_from_db()
    # Then the plain task ends in the first update's state; the ordered one ran them in order
    assert order.status == final
    if task is tasks.status_guarded:
        assert report.order == [0, 1, 2]
    else:
        assert report.order == [2, 1, 0]


# -- store_outage -------------------------------------------------------------------------------------------


@pytest.fixture
def cuttable() -> None:
    """The store can be cut: not on SQLite, a file (the SQLite pass of the suite skips these)."""
    from celery_guardrails.testing import current_kit

    if current_kit().no_outage:
        pytest.skip(current_kit().no_outage)


def test_store_outage_catches_a_handler_that_acks_a_failure(cuttable: None) -> None:
    k = key()
    report = store_outage(tasks.swallow_plain, k)
    assert report.outcomes == [("succeeded", "")]  # acked, with nothing written
    with pytest.raises(AssertionError, match="happened 0 times, expected 1"):
        assert_single_effect(Effect.objects.filter(key=k))


def test_store_outage_passes_the_guarded_task(cuttable: None) -> None:
    k = key()
    report = store_outage(tasks.swallow_guarded, k)
    assert report.outcomes[0] == ("retried", "store_unavailable")
    assert report.outcomes[-1] == ("succeeded", "")
    assert_single_effect(Effect.objects.filter(key=k))
    assert_no_loss()


# -- deploy_during_processing ---------------------------------------------------------------------------------


def test_deploy_catches_a_shape_change_with_no_version() -> None:
    old = Release(messages=[(1, 10.5), (2, 20.0)], app="tests.kit_proj.old_app:app")
    new = Release(messages=[(3, 3000, "EUR"), (4, 4000, "EUR")])
    deploy_during_processing(tasks.pay_plain, old=old, new=new)
    with pytest.raises(AssertionError, match="lost"):
        assert_no_loss()


def test_deploy_passes_versioned_payloads() -> None:
    old = Release(messages=[(11, 10.5), (12, 20.0)], version=1, app="tests.kit_proj.old_app:app")
    new = Release(messages=[(13, 3000, "EUR"), (14, 4000, "EUR")], version=2)
    report = deploy_during_processing(tasks.pay_guarded, old=old, new=new)
    assert_no_loss()
    keys = sorted(Effect.objects.filter(key__startswith="pay:1").values_list("key", flat=True))
    assert keys == ["pay:11:1050EUR", "pay:12:2000EUR", "pay:13:3000EUR", "pay:14:4000EUR"]
    # The old worker refused the new shape it could not read; the replay ran it on the new worker
    assert report.details["replayed"]
    for task_id in report.details["replayed"]:
        assert_dead_lettered(task_id, reason="unknown_payload_version")


# -- the other pools, and RabbitMQ ----------------------------------------------------------------------------


@pytest.mark.guardrails(pool="threads", concurrency=2)
def test_on_a_threads_pool() -> None:
    plain, guarded, job = key(), key(), key()
    deliver_twice(tasks.record_plain, plain, concurrently=True)
    deliver_twice(tasks.record_guarded, guarded, concurrently=True)
    report = crash_mid_task(tasks.items_guarded, job, 6, at="half")
    with pytest.raises(AssertionError, match="happened 2 times"):
        assert_single_effect(Effect.objects.filter(key=plain))
    assert_single_effect(Effect.objects.filter(key=guarded))
    assert report.crashes == 1
    assert_single_effect(ChunkItem.objects.filter(job=job), expected=6)


@pytest.mark.guardrails(app="tests.kit_proj.amqp:app", pool="prefork")
def test_on_rabbitmq_the_broker_gives_the_message_back() -> None:
    from tests.kit_proj import amqp

    require("rabbitmq")
    plain, guarded = key(), key()
    # Given RabbitMQ, which gives a dead consumer's unacked messages back itself
    deliver_twice(amqp.record_plain, plain)
    twice = deliver_twice(amqp.record_guarded, guarded)
    crashed = crash_mid_task(amqp.record_guarded, key(), at="written")
    with pytest.raises(AssertionError, match="happened 2 times"):
        assert_single_effect(Effect.objects.filter(key=plain))
    assert_single_effect(Effect.objects.filter(key=guarded))
    assert twice.outcomes == [("succeeded", ""), ("duplicate_skipped", "completed")]
    assert crashed.crashes == 1
    assert crashed.outcomes == [("succeeded", "")]
    assert_no_loss()
