"""Both real stores keep a long job's checkpoint the same way: a compare-and-set on the position, a small JSON
state saved with it, marked done (or cleared) at the end; the Django store's write belongs to the caller's
transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails.stores.base import StoredCheckpoint
from tests.support.stores import forget

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def key(kind: str) -> Iterator[str]:
    key = f"tests.checkpoint:-:{uuid.uuid4().hex}"
    yield key
    forget(kind, f"*{key}*")


def test_checkpoint_lifecycle(store: Any, key: str) -> None:
    # Given a job with no checkpoint yet: it starts at 0, with no state
    assert store.load_checkpoint(key) == StoredCheckpoint(position=0, state="", done=False)
    # When its chunks are saved one after the other, each from the position the one before stored
    assert store.save_checkpoint(key, expected=0, position=100, state='{"sum":4950}', ttl=600) is True
    assert store.save_checkpoint(key, expected=100, position=200, state='{"sum":19900}', ttl=600) is True
    # Then the last one is read back, state and all
    assert store.load_checkpoint(key) == StoredCheckpoint(position=200, state='{"sum":19900}')
    # And once marked done (the task succeeded, its ack not yet sent) it reads back done, position and state
    # kept; marking it twice (a redelivery that succeeded again) is harmless
    store.complete_checkpoint(key, ttl=600)
    store.complete_checkpoint(key, ttl=600)
    assert store.load_checkpoint(key) == StoredCheckpoint(position=200, state='{"sum":19900}', done=True)
    # And once cleared (a keyed job: its key completed) the next run starts over; clearing twice is harmless
    store.clear_checkpoint(key)
    store.clear_checkpoint(key)
    assert store.load_checkpoint(key) == StoredCheckpoint()


def test_a_job_with_no_checkpoint_yet_can_be_marked_done(store: Any, key: str) -> None:
    # Given a job that iterated nothing (no position saved), When its task succeeds, Then it is done all the same
    store.complete_checkpoint(key, ttl=600)
    assert store.load_checkpoint(key) == StoredCheckpoint(done=True)


def test_a_save_from_a_stale_position_is_refused_and_changes_nothing(store: Any, key: str) -> None:
    # Given two deliveries of one job that both loaded position 0, and the first saved its chunk
    assert store.save_checkpoint(key, expected=0, position=100, state="", ttl=600) is True
    # When the second saves its own chunk from 0, or any position other than the stored one
    assert store.save_checkpoint(key, expected=0, position=100, state='"other"', ttl=600) is False
    assert store.save_checkpoint(key, expected=50, position=150, state='"other"', ttl=600) is False
    assert store.save_checkpoint(key, expected=200, position=300, state='"other"', ttl=600) is False
    # Then it is refused every time, and the first one's checkpoint stands
    assert store.load_checkpoint(key) == StoredCheckpoint(position=100)


def test_checkpoints_are_kept_per_key(store: Any, key: str) -> None:
    other = f"{key}-other"
    try:
        assert store.save_checkpoint(key, expected=0, position=10, state="", ttl=600)
        assert store.save_checkpoint(other, expected=0, position=20, state="", ttl=600)
        store.clear_checkpoint(other)
        assert (store.load_checkpoint(key), store.load_checkpoint(other)) == (
            StoredCheckpoint(position=10),
            StoredCheckpoint(),
        )
    finally:
        store.clear_checkpoint(other)


def test_the_redis_checkpoint_expires_after_its_ttl(kind: str, store: Any, key: str) -> None:
    # Given the Redis store (the database keeps a checkpoint until it is cleared or pruned)
    if kind == "django":
        pytest.skip("the Django store keeps checkpoints until cleared or pruned")
    from celery_guardrails.stores.redis_checkpoint import checkpoint_key

    # When a checkpoint is saved with a TTL of 600 s, then again with 900 s
    store.save_checkpoint(key, expected=0, position=1, state="", ttl=600)
    first = store.client.ttl(checkpoint_key(key))
    store.save_checkpoint(key, expected=1, position=2, state="", ttl=900.5)
    second = store.client.ttl(checkpoint_key(key))
    # And marked done with 300 s
    store.complete_checkpoint(key, ttl=300)
    # Then every save sets it again (rounded up to whole seconds): a job that stops for good leaves nothing;
    # and so does the done mark (it is kept only as long as a redelivery before the ack could come)
    assert 590 < first <= 600
    assert 890 < second <= 901
    assert 290 < store.client.ttl(checkpoint_key(key)) <= 300


def test_the_django_save_commits_or_rolls_back_with_the_callers_transaction(kind: str, store: Any, key: str) -> None:
    if kind != "django":
        pytest.skip("the Redis store cannot share the caller's transaction")
    from django.db import transaction

    from tests.testapp.models import Effect

    # Given a chunk's transaction holding an effect and the checkpoint's first save
    class Killed(Exception):
        pass

    with pytest.raises(Killed), transaction.atomic():
        Effect.objects.create(key=key)
        assert store.save_checkpoint(key, expected=0, position=100, state="", ttl=600) is True
        raise Killed  # When the chunk fails before its commit
    # Then neither the effect nor the position is kept: the next run does that chunk again, from 0
    assert (Effect.objects.filter(key=key).count(), store.load_checkpoint(key)) == (0, StoredCheckpoint())
    # And when the next chunk's transaction commits, both are kept
    with transaction.atomic():
        Effect.objects.create(key=key)
        assert store.save_checkpoint(key, expected=0, position=100, state="", ttl=600) is True
    assert (Effect.objects.filter(key=key).count(), store.load_checkpoint(key)) == (1, StoredCheckpoint(position=100))
