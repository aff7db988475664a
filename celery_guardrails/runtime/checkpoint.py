"""Resumable chunks for long jobs: ``for item in self.checkpoint.iterate(items, every=100): ...``.

The position reached (items done) is recorded in the store every ``every`` items, so a job killed by a deploy
resumes where it stopped instead of starting over. It is keyed by the job: the scoped idempotency key
of a keyed task; else the task id (``task:tenant:task-id:<id>``), which a
redelivery, a retry and a ``RetryLater`` keep (a replay of a dead letter, a new message, starts over).

* ``items`` is a sequence read again on every delivery in the same order (a list, a range, a tuple, a
  Django queryset with ``order_by``): the position is an index, and a resumed run skips the first
  ``position`` items (a queryset is sliced, so the database skips them). An iterator, a set, a mapping, a
  string or an unordered queryset is refused with :class:`~celery_guardrails.exceptions.CheckpointError`.
* Django store: each chunk of ``every`` items runs in its own ``transaction.atomic()`` with the checkpoint's
  write, so the chunk's database effects and its position commit together. A worker killed mid-chunk rolls
  the chunk back and the job resumes at the chunk's start: every item's database effect happens exactly once.
  So the chunks must be able to commit: the body must not run in a transaction (``atomic=True``, or the
  loop inside the task's own ``transaction.atomic()``) — refused with a clear error.
* Redis store: the position is written after each chunk (Redis cannot commit with the effects): a worker
  killed mid-chunk repeats that chunk. At least once per chunk, like the Redis store's idempotency.
* A save is a compare-and-set on the position: a second delivery running the same job at once (a lease that
  lapsed, a broker that redelivered early) cannot move it; the one that finds it moved stops with
  ``RetryLater`` (no attempt spent; on Django its chunk rolls back) and comes back to a completed key or the
  later position.
* The body's failure: on Django the open chunk rolls back; on Redis the items finished before the failing one
  are saved. A retry (``TransientError``, ``RetryLater``, ``self.retry``) keeps the checkpoint and resumes
  from it; so does a final failure (a replay of the dead letter of a keyed task resumes).
* The task's success: the acks-late ack comes after the success hooks (in prefork, in the worker's main
  process, once the child has reported), so a worker killed between the two gets its message delivered
  again. A keyed job's checkpoint is cleared: its key was completed first (committed on Django, sent ahead on
  the same connection on Redis), so the redelivery is skipped as a duplicate. A job without a key has no
  such record: its checkpoint is marked done instead, and a redelivery's ``iterate`` yields nothing (no item
  runs twice, not all of them again); the mark goes after ``idempotency_retention`` (Redis expiry,
  ``guardrails_prune``).
* A store that cannot be reached while saving is an outage like any other: the chunk rolls back (Django) and
  the message comes back later without spending an attempt.
* ``state``: a small JSON value saved with each position (a running total, a cursor of your own), read back
  by a resumed run: ``self.checkpoint.state = {"sum": total}``.

The idempotency claim's lease is renewed by its heartbeat thread throughout, whatever the chunks do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Set
from contextlib import AbstractContextManager
from itertools import islice
from typing import TYPE_CHECKING, Any

from celery_guardrails.exceptions import CheckpointError, ConfigurationError, RetryLater, SlotLostError, StoreError
from celery_guardrails.foundation.context import current_tenant
from celery_guardrails.guardrails.concurrency import fence
from celery_guardrails.runtime.delivery import ATTRIBUTE, delivery, view
from celery_guardrails.runtime.pipeline import Guardrail
from celery_guardrails.stores import get_store, store_url

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: The request attribute holding the delivery's checkpoint.
REQUEST_ATTRIBUTE = "_guardrails_checkpoint"
#: Largest ``state``, in characters of its JSON text: a checkpoint is written every chunk.
STATE_MAX_LENGTH = 65_536


class Checkpoint:
    """The checkpoint of the job a delivery runs (``self.checkpoint``; see the module docstring)."""

    def __init__(self, task: GuardedTask, key: str, *, keyed: bool = False) -> None:
        self.task = task
        self.key = key
        #: The job's key is its idempotency key (completed on success), not its task id.
        self.keyed = keyed
        self.store = get_store(task.app)
        #: Django store: chunks commit in the database with their position.
        self.transactional = store_url(task.app) == "django"
        self.error: StoreError | None = None  # the store error this checkpoint raised into the body
        self._loaded = False
        self._saved = 0  # the position stored (the compare-and-set's expected value)
        self._position = 0
        self._state_text = ""
        self._done = False  # the task succeeded already: this is a redelivery that came before the ack
        self._iterating = False
        self._chunk: AbstractContextManager[Any] | None = None  # the open chunk's transaction (Django)

    @property
    def position(self) -> int:
        """Items done: where a resumed run starts, and inside the loop the index of the current item."""
        self._load()
        return self._position

    @property
    def state(self) -> Any:
        """The JSON value saved with the position (None when none was)."""
        self._load()
        return json.loads(self._state_text) if self._state_text else None

    @state.setter
    def state(self, value: Any) -> None:
        try:
            text = "" if value is None else json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.task.name}: checkpoint state must be JSON: {exc}") from exc
        if len(text) > STATE_MAX_LENGTH:
            raise CheckpointError(
                f"{self.task.name}: checkpoint state is {len(text)} characters of JSON, over {STATE_MAX_LENGTH}"
            )
        self._load()
        self._state_text = text

    def iterate(self, items: Any, every: int = 100) -> Iterator[Any]:
        """The items not done yet, recording the position every ``every`` items (see the module docstring)."""
        name = self.task.name
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(f"{name}: checkpoint every= must be a positive int, got {every!r:.40}")
        if (
            isinstance(items, str | bytes | bytearray | Mapping | Set)
            or not hasattr(items, "__len__")
            or not hasattr(items, "__getitem__")
        ):
            raise CheckpointError(
                f"{name}: checkpoint.iterate needs a sequence read in the same order on every delivery (a list, "
                f"a range, an ordered queryset), got {type(items).__name__}"
            )
        if getattr(items, "ordered", True) is False:  # a Django queryset without order_by: no stable order
            raise CheckpointError(f"{name}: checkpoint.iterate needs an ordered queryset: add order_by(...)")
        if self._iterating:
            raise CheckpointError(f"{name}: checkpoint.iterate may be used once per run (one position per job)")
        if view(self.task).options["atomic"]:
            raise ConfigurationError(
                "atomic",
                f"{name}: checkpoint.iterate cannot run with atomic=True: the whole body is one transaction, "
                "so no chunk could commit on its own (a killed job would lose its positions or its effects)",
            )
        if self.transactional:
            from django.db import connection

            if connection.in_atomic_block:
                raise CheckpointError(
                    f"{name}: checkpoint.iterate inside a transaction: its chunks could not commit on their own"
                )
        self._load()
        self._iterating = True
        return self._run(items, every)

    def _run(self, items: Any, every: int) -> Iterator[Any]:
        if self._done:
            logger.warning(
                "Task %s[%s]: %s already completed (delivered again after its success, before the ack): no item "
                "runs again",
                self.task.name,
                self.task.request.id,
                self.key,
            )
            return
        start = self._position
        if start:
            logger.info(
                "Task %s[%s]: resuming %s at item %d of %d",
                self.task.name,
                self.task.request.id,
                self.key,
                start,
                len(items),
            )
        # A queryset is sliced (OFFSET: the database skips the rows); a sequence is skipped over in place.
        remaining = items[start:] if hasattr(items, "query") else islice(items, start, None)
        for item in remaining:
            if self._chunk is None and self.transactional:
                self._begin()
            yield item
            self._position += 1
            if self._position - self._saved >= every:
                self._save()
        if self._position != self._saved or self._chunk is not None:
            self._save()

    def _load(self) -> None:
        if self._loaded:
            return
        try:
            found = self.store.load_checkpoint(self.key)
        except StoreError as exc:
            self.error = exc
            raise
        self._saved, self._state_text, self._done = found.position, found.state, found.done
        self._position = self._saved
        self._loaded = True

    def _begin(self) -> None:
        from django.db import transaction

        chunk = transaction.atomic()
        chunk.__enter__()
        self._chunk = chunk

    def _save(self) -> None:
        """Write the position (in the open chunk's transaction, then commit it: Django)."""
        ttl = view(self.task).options["idempotency_retention"]
        try:
            # Fencing (owned by the concurrency guardrail): a holder whose slot was reaped saves nothing; on
            # Django the check joins the chunk's transaction, so the chunk rolls back with it.
            fence(self.task, "checkpoint")
        except SlotLostError as exc:
            self._end(exc)
            raise
        try:
            saved = self.store.save_checkpoint(
                self.key, expected=self._saved, position=self._position, state=self._state_text, ttl=ttl
            )
        except StoreError as exc:
            self.error = exc
            self._end(exc)
            raise
        if not saved:
            conflict = RetryLater(f"checkpoint {self.key} was moved by another delivery of this job")
            logger.warning(
                "Task %s[%s]: checkpoint %s moved by another delivery (expected %d); stopping this one",
                self.task.name,
                self.task.request.id,
                self.key,
                self._saved,
            )
            self._end(conflict)
            raise conflict
        self._end(None)
        self._saved = self._position

    def _end(self, error: BaseException | None) -> None:
        """Commit the open chunk (``error`` None) or roll it back."""
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            return
        from django.db import DatabaseError

        if error is not None:
            try:
                chunk.__exit__(type(error), error, error.__traceback__)
            except DatabaseError:  # the connection is gone: the server rolls the chunk back without it
                logger.warning("Checkpoint %s: its chunk could not be rolled back here", self.key, exc_info=True)
            return

        try:
            chunk.__exit__(None, None, None)
        except DatabaseError as exc:  # the commit failed: the chunk and its position are not kept
            from celery_guardrails.stores.database import failure

            self.error = failure("commit a chunk with its checkpoint", exc)
            raise self.error from exc

    def finish(self, error: BaseException | None) -> None:
        """The body is over. Returned: an open chunk (the loop was left early) commits with its position.
        Raised: on Django the open chunk rolls back; on Redis the items done before the failing one are saved,
        unless the store is what failed."""
        if not self._iterating or (self._chunk is None and self._position == self._saved):
            return
        if error is None:
            self._save()
            return
        if self.transactional:
            self._end(error)
            return
        if self.error is None:
            try:
                self._save()
            except (StoreError, RetryLater):
                logger.warning(
                    "Task %s[%s]: checkpoint %s not saved after the body failed; the next run repeats its chunk",
                    self.task.name,
                    self.task.request.id,
                    self.key,
                    exc_info=True,
                )


def checkpoint_of(task: GuardedTask) -> Checkpoint:
    """The checkpoint of the delivery ``task`` is running (``self.checkpoint``); CheckpointError outside one."""
    request = task.request
    found: Checkpoint | None = getattr(request, REQUEST_ATTRIBUTE, None)
    if found is not None:
        return found
    state = getattr(request, ATTRIBUTE, None)
    # The scoped key from the delivery's state (the request's own idempotency_key is the opaque one a body
    # hands downstream, and reading it counts as handing it on).
    key = state.key if state is not None else None
    keyed = bool(key)
    if state is None or not (request.id or key):
        raise CheckpointError(
            f"{task.name}: self.checkpoint is only available inside the body of a running task (bind=True)"
        )
    if not key:
        from celery_guardrails.guardrails.keys import scoped_key

        key = scoped_key(task.name, current_tenant(), f"task-id:{request.id}")
    found = Checkpoint(task, key, keyed=keyed)
    setattr(request, REQUEST_ATTRIBUTE, found)
    return found


class _Settle:
    """Around the body: settles the checkpoint the body used, if any (a plain class: every task enters one)."""

    __slots__ = ("task",)

    def __init__(self, task: GuardedTask) -> None:
        self.task = task

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        checkpoint: Checkpoint | None = getattr(self.task.request, REQUEST_ATTRIBUTE, None)
        if checkpoint is None:
            return
        checkpoint.finish(exc)
        if exc is not None and checkpoint.error is not None and exc is checkpoint.error:
            # The store failed under the checkpoint, not the task's own code: an outage that GuardedTask settles
            # (the message comes back later, no attempt spent), not an error of the body to classify.
            delivery(self.task).body_error = None


class Checkpoints(Guardrail):
    """Settles a delivery's checkpoint: its open chunk when the body ends; when the task succeeds, clears it
    (keyed) or marks it done (see the module docstring)."""

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any] | None:
        return _Settle(task)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        checkpoint: Checkpoint | None = getattr(task.request, REQUEST_ATTRIBUTE, None)
        if checkpoint is None or not checkpoint._iterating:
            return
        if checkpoint.keyed:
            # The key's completion went to the store before this hook (the body's end), and it outlives the
            # ack: a redelivery after a kill here is a duplicate skipped, never a run from item 0.
            checkpoint.store.clear_checkpoint(checkpoint.key)
            return
        # No key: nothing else records that the job is done until the ack removes its message. Deleting the
        # checkpoint here would let a kill before that ack start the job again at item 0 (issue #29).
        ttl = view(task).options["idempotency_retention"]
        checkpoint.store.complete_checkpoint(checkpoint.key, ttl=ttl)
