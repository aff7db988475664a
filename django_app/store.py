"""The Django database store (``store="django"``): one row per dependency, changed under a row lock.

Each operation is one transaction that locks the dependency's row (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite serialises writers) and applies the rules of :mod:`celery_guardrails.stores.base`
as they are. On SQLite with several worker processes, set ``"OPTIONS": {"transaction_mode": "IMMEDIATE"}``
(Django 5.1+) so concurrent transactions wait for the lock instead of failing with "database is locked".
Idempotency keys and the run ledger take no lock: a unique INSERT and conditional UPDATEs (see below).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Case, Count, F, FloatField, Q, QuerySet, Value, When
from django.db.models.functions import Concat
from django.utils import timezone

from celery_guardrails.exceptions import StoreError, StoreUnavailableError
from celery_guardrails.scheduling.ledger import (
    DISPATCHED,
    MISSED,
    OVERDUE,
    REASON_MAX_LENGTH,
    RUNNING,
    WAS_OVERDUE,
    Heads,
    Run,
)
from celery_guardrails.stores.base import (
    ACQUIRED,
    BUSY,
    COMPLETED,
    FAILED,
    HELD,
    LOST,
    Activity,
    Admission,
    BudgetPolicy,
    Claim,
    DependencyState,
    OrderState,
    OrderWait,
    OrderWaits,
    OutcomeCount,
    QueueSample,
    SlotAcquisition,
    SlotHolder,
    StoredCheckpoint,
    Wait,
    Waits,
    decide_admission,
    decide_outcome,
    status,
)

from .models import (
    ActivityBatch,
    ActivityCount,
    AlertThrottle,
    Checkpoint,
    ConcurrencyKey,
    ConcurrencySlot,
    DeliveryCounter,
    IdempotencyKey,
    OrderingSequence,
    ScheduledRun,
    WaitingMessage,
)
from .models import DependencyState as Row
from .models import QueueSample as QueueSampleRow

_FIELDS = [f.name for f in fields(DependencyState)]
#: The fields of a Wait its row keeps as they are (the task id first: the row's key), and its times.
_WAIT_COPIED = ("task_id", "task_name", "tenant", "queue", "reason", "detail", "attempt")
_WAIT_TIMES = ("due_at", "since", "expires_at")
#: Schedules read per query by run_heads.
HEADS_CHUNK = 500
T = TypeVar("T")
P = ParamSpec("P")


def failure(what: str, exc: DatabaseError) -> StoreError:
    """The store's error for a database error: unavailable when the database cannot be reached or used now
    (a lost or refused connection, a locked SQLite file: OperationalError, InterfaceError), refused for an
    error about the data (DataError, IntegrityError, ProgrammingError)."""
    if isinstance(exc, OperationalError | InterfaceError):
        return StoreUnavailableError(f"Django store could not {what}: {exc}")
    return StoreError(f"Django store refused to {what}: {exc}")


def translated(what: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Every database error of the decorated operation raised as the store's own (see :func:`failure`)."""

    def decorate(operation: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(operation)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return operation(*args, **kwargs)
            except DatabaseError as exc:
                raise failure(what, exc) from exc

        return run

    return decorate


def _moment(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _period(seconds: float) -> datetime:
    """A period's due instant, in whole seconds: the Redis store keys periods the same way."""
    return _moment(round(seconds))


def _seconds(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


#: The fields of a ledger record, read as values (no model instance made for each of thousands of rows).
RUN_FIELDS = (
    "schedule",
    "period",
    "status",
    "task_id",
    "dispatched_at",
    "started_at",
    "finished_at",
    "reason",
    "missed_at",
    "overdue_at",
)


def _run(row: dict[str, Any]) -> Run:
    return Run(
        schedule=row["schedule"],
        period=row["period"].timestamp(),
        status=row["status"],
        task_id=row["task_id"],
        dispatched_at=_seconds(row["dispatched_at"]),
        started_at=_seconds(row["started_at"]),
        finished_at=_seconds(row["finished_at"]),
        reason=row["reason"],
        missed_at=_seconds(row["missed_at"]),
        overdue_at=_seconds(row["overdue_at"]),
    )


def _state(row: Row) -> DependencyState:
    return DependencyState(**{name: getattr(row, name) for name in _FIELDS})


def _save(row: Row, state: DependencyState) -> None:
    for name in _FIELDS:
        setattr(row, name, getattr(state, name))
    row.save()


def _quoted(*names: str) -> list[str]:
    return [connection.ops.quote_name(name) for name in (IdempotencyKey._meta.db_table, *names)]


@functools.cache
def _claim_sql(vendor: str, relaxed: bool) -> str:
    """The claim of a new key: one INSERT that inserts nothing when the key exists (PostgreSQL, SQLite).
    ``relaxed`` (PostgreSQL): its commit does not wait for the disk (``synchronous_commit`` off for this
    statement's own transaction; see :meth:`DjangoStore._insert_claim`)."""
    table, key, state, owner, lease_until, created_at = _quoted("key", "state", "owner", "lease_until", "created_at")
    insert = (
        f"INSERT INTO {table} ({key}, {state}, {owner}, {lease_until}, summary, reason, {created_at}, finished_at) "
        f"VALUES (%s, 'claimed', %s, %s, '', '', %s, NULL) ON CONFLICT ({key}) DO NOTHING"
    )
    if not relaxed:
        return insert
    # A CTE runs only when read: RETURNING reads it for the inserted row, before the statement commits.
    return (
        "WITH relaxed AS (SELECT set_config('synchronous_commit', 'off', true) AS off) "
        f"{insert} RETURNING (SELECT off FROM relaxed)"
    )


@functools.cache
def _finish_sql(vendor: str, column: str) -> str:
    """The owner's claim completed or failed, ``column`` (summary or reason) set: one UPDATE, on any database
    (``vendor`` only keys the cache: quoting differs between databases)."""
    table, key, state, owner, lease_until, text, finished_at = _quoted(
        "key", "state", "owner", "lease_until", column, "finished_at"
    )
    return (
        f"UPDATE {table} SET {state} = %s, {lease_until} = NULL, {text} = %s, {finished_at} = %s "
        f"WHERE {key} = %s AND {owner} = %s AND {state} = 'claimed'"
    )


class DjangoStore:
    """Store in the Django database (the ``guardrails`` app's tables)."""

    def _change(self, dependency: str, rule: Callable[[DependencyState], T]) -> T:
        """Apply ``rule`` to the dependency's state under its row lock; save; return what the rule said."""
        try:
            with transaction.atomic():
                row = Row.objects.locked(dependency)
                state = _state(row)
                result = rule(state)
                _save(row, state)
        except DatabaseError as exc:
            raise failure(f"change the state of {dependency!r}", exc) from exc
        return result

    def admit(self, dependency: str, policy: BudgetPolicy, *, retry: bool, now: float) -> Admission:
        return self._change(dependency, lambda state: decide_admission(state, policy, retry=retry, now=now))

    def record_outcome(self, dependency: str, policy: BudgetPolicy, *, outcome: str, now: float) -> bool:
        return self._change(dependency, lambda state: decide_outcome(state, policy, outcome=outcome, now=now))

    @translated("read a dependency's state")
    def budget_status(self, dependency: str, policy: BudgetPolicy, *, now: float) -> dict[str, Any]:
        row = Row.objects.filter(dependency=dependency).first()
        return status(dependency, _state(row) if row else DependencyState(), policy, now)

    @translated("reset a dependency")
    def reset(self, dependency: str) -> None:
        Row.objects.filter(dependency=dependency).delete()

    def close_thread(self) -> None:
        """A helper thread (the heartbeat) is done: close its own database connection."""
        connection.close()

    # Idempotency keys: a claim is an INSERT that inserts nothing when the key exists (the unique constraint
    # decides); every later change is a conditional UPDATE (only the current owner, only from the expected
    # state), so two deliveries can never both hold a key. A new key, the common case, costs one statement to
    # claim and one to complete (in the effect's transaction with atomic=True); statements are written out for
    # these two, where building them through the ORM cost more than sending them. Retention is enforced by the
    # prune command, not by the database.

    @translated("claim a key")
    def claim(
        self,
        key: str,
        *,
        owner: str,
        now: float,
        lease: float,
        retention: float,
        replaces: str = "",
        atomic: bool = False,
    ) -> Claim:
        until = _moment(now + lease)
        if self._insert_claim(key, owner=owner, until=until, atomic=atomic):
            return Claim(state=ACQUIRED)
        if self._owned(key, owner).update(lease_until=until):  # this delivery asking again: it holds it
            return Claim(state=ACQUIRED)
        gone = Q(lease_until__lte=_moment(now)) | (Q(owner=replaces) if replaces else Q(pk__in=[]))
        taken = IdempotencyKey.objects.filter(gone, key=key, state="claimed").update(owner=owner, lease_until=until)
        if taken:
            return Claim(state=ACQUIRED, takeover=True)
        fields = ("state", "lease_until", "summary", "reason", "owner")
        row = IdempotencyKey.objects.filter(key=key).values(*fields).first()
        if row is None:  # released between the INSERT and the read: claim again
            return self.claim(
                key, owner=owner, now=now, lease=lease, retention=retention, replaces=replaces, atomic=atomic
            )
        if row["state"] == "completed":
            return Claim(state=COMPLETED, summary=row["summary"], owner=row["owner"] or "")
        if row["state"] == "failed":
            return Claim(state=FAILED, reason=row["reason"], owner=row["owner"] or "")
        return Claim(state=BUSY, lease_until=row["lease_until"].timestamp(), owner=row["owner"])

    def _insert_claim(self, key: str, *, owner: str, until: datetime, atomic: bool) -> bool:
        """Insert the key claimed by ``owner``; False when it exists.

        On PostgreSQL and SQLite one ``INSERT ... ON CONFLICT DO NOTHING`` (one round trip; outside a transaction
        no BEGIN and COMMIT of its own); elsewhere an INSERT the unique constraint refuses, in a transaction.

        On PostgreSQL, the claim of an ``atomic`` task outside a transaction does not wait for its commit to reach
        the disk. Nothing is weaker for it: the completion commits (synchronously) in the effect's transaction,
        and PostgreSQL flushes its WAL in order, so that commit makes the claim durable first. A server crash can
        lose only a claim whose effect had not committed either; the holder's connection dies with it (a store
        outage: its message comes back), and the next delivery claims the key afresh. Without ``atomic`` the
        effect may be outside the database, where a lost claim could let a duplicate run beside it: that claim
        waits for the disk.
        """
        vendor = connection.vendor
        if vendor not in ("postgresql", "sqlite"):
            try:
                with transaction.atomic():
                    IdempotencyKey.objects.create(key=key, owner=owner, lease_until=until)
            except IntegrityError:
                return False
            return True
        nested = connection.in_atomic_block  # the setting would last for the caller's whole transaction
        adapt = connection.ops.adapt_datetimefield_value
        values = [key, owner, adapt(until), adapt(timezone.now())]
        # Inside the caller's transaction, a savepoint: an error here must not break the caller's transaction.
        savepoint = transaction.atomic() if nested else contextlib.nullcontext()
        with savepoint, connection.cursor() as cursor:
            cursor.execute(_claim_sql(vendor, atomic and not nested and vendor == "postgresql"), values)
            return bool(cursor.rowcount == 1)

    def _owned(self, key: str, owner: str) -> Any:
        return IdempotencyKey.objects.filter(key=key, owner=owner, state="claimed")

    @translated("extend a lease")
    def extend(self, key: str, *, owner: str, now: float, lease: float) -> bool:
        return bool(self._owned(key, owner).update(lease_until=_moment(now + lease)))

    @translated("finish a key")
    def _finish(self, key: str, owner: str, state: str, *, text: str, value: str, now: float) -> bool:
        finished_at = connection.ops.adapt_datetimefield_value(_moment(now))
        with transaction.mark_for_rollback_on_error(), connection.cursor() as cursor:
            cursor.execute(_finish_sql(connection.vendor, text), [state, value[:200], finished_at, key, owner])
            if cursor.rowcount:
                return True
        # A finish repeated by the owner that made it (its first answer was lost) succeeds again.
        return bool(IdempotencyKey.objects.filter(key=key, owner=owner, state=state).exists())

    def complete(self, key: str, *, owner: str, now: float, summary: str, retention: float) -> bool:
        return self._finish(key, owner, "completed", text="summary", value=summary, now=now)

    def begin_complete(self, key: str, *, owner: str, now: float, summary: str, retention: float) -> Callable[[], bool]:
        # A database round trip cannot be left in flight: complete now, answer when asked.
        done = self.complete(key, owner=owner, now=now, summary=summary, retention=retention)
        return lambda: done

    def fail(self, key: str, *, owner: str, now: float, reason: str, retention: float) -> bool:
        return self._finish(key, owner, "failed", text="reason", value=reason, now=now)

    @translated("release a key")
    def release(self, key: str, *, owner: str) -> bool:
        deleted, _ = self._owned(key, owner).delete()
        return bool(deleted)

    @translated("reopen a key")
    def reopen(self, key: str) -> bool:
        deleted, _ = IdempotencyKey.objects.filter(key=key, state="failed").delete()
        return bool(deleted)

    @translated("reopen keys")
    def reopen_keys(self, keys: Iterable[str]) -> int:
        wanted = list(keys)
        # A few hundred keys a statement: one round trip each, and well inside SQLite's limit of parameters.
        return sum(
            IdempotencyKey.objects.filter(key__in=wanted[start : start + 500], state="failed").delete()[0]
            for start in range(0, len(wanted), 500)
        )

    @translated("read a key")
    def inspect(self, key: str) -> dict[str, Any] | None:
        row: dict[str, Any] | None = IdempotencyKey.objects.filter(key=key).values().first()
        return row

    @translated("reserve a publish")
    def reserve_publish(self, key: str, *, task_id: str, ttl: float) -> str | None:
        marker, now = f"published:{key}", datetime.now(UTC)
        try:
            with transaction.atomic():
                IdempotencyKey.objects.create(key=marker, state="completed", summary=task_id, finished_at=now)
            return None
        except IntegrityError:
            pass
        renewed = IdempotencyKey.objects.filter(key=marker, finished_at__lt=now - timedelta(seconds=ttl)).update(
            summary=task_id, finished_at=now
        )
        if renewed:
            return None
        return IdempotencyKey.objects.filter(key=marker).values_list("summary", flat=True).first()

    # Poison protection: start counts of redelivered messages.

    @translated("count a delivery")
    def count_delivery(self, message_id: str, *, ttl: float) -> int:
        with transaction.atomic():
            counter, created = DeliveryCounter.objects.select_for_update().get_or_create(message_id=message_id)
            if not created:
                counter.starts = F("starts") + 1
                counter.save(update_fields=["starts", "updated_at"])
                counter.refresh_from_db(fields=["starts"])
        return int(counter.starts)

    @translated("clear a delivery count")
    def clear_delivery(self, message_id: str) -> None:
        DeliveryCounter.objects.filter(message_id=message_id).delete()

    # Alert throttling: one row per (owner, task, reason) group.

    @translated("throttle an alert")
    def throttle(self, group: str, *, window: float, now: float, extend_for: float = 0.0) -> bool:
        with transaction.atomic():
            row, _ = AlertThrottle.objects.select_for_update().get_or_create(group=group)
            if row.until > now:
                row.suppressed = F("suppressed") + 1
                if extend_for > 0:
                    row.until = max(row.until, min(now + window, row.opened + extend_for))
                row.save(update_fields=["suppressed", "until"])
                return False
            row.until, row.opened = now + window, now
            row.save(update_fields=["until", "opened"])
            return True

    @translated("read the alert summaries due")
    def due_summaries(self, *, now: float) -> list[tuple[str, int]]:
        due = []
        with transaction.atomic():
            for row in AlertThrottle.objects.select_for_update().filter(until__lte=now, suppressed__gt=0):
                due.append((row.group, row.suppressed))
                row.suppressed = 0
                row.save(update_fields=["suppressed"])
        return due

    # Ordering per key: one row per key. Every change is one conditional UPDATE (compare and set on ``done``) or
    # the INSERT of a new key, which the unique constraint settles between two publishers; each runs in the
    # operation's transaction, so the sequence number read back is the one this UPDATE made (its row stays
    # locked until the commit on PostgreSQL; SQLite has one writer at a time). The rules are those of the Redis
    # store's script (celery_guardrails.stores.redis_ordering). Retention: ``updated_at`` says when a key was
    # last used; idle rows are small and are not deleted here.

    @translated("hand out a sequence number")
    def order_next(self, key: str, *, now: float, retention: float) -> int:
        rows = OrderingSequence.objects.filter(key=key)
        with transaction.atomic():
            if not rows.update(issued=F("issued") + 1, updated_at=timezone.now()):
                try:
                    with transaction.atomic():  # a savepoint: a refused INSERT leaves the transaction usable
                        OrderingSequence.objects.create(key=key, issued=1)
                    return 1
                except IntegrityError:  # another publisher made the key first: count on it
                    rows.update(issued=F("issued") + 1, updated_at=timezone.now())
            return int(rows.values_list("issued", flat=True).get())

    @translated("read an ordering key")
    def order_check(self, key: str, *, sequence: int, now: float, retention: float) -> OrderState:
        rows = OrderingSequence.objects.filter(key=key)
        names = [field.name for field in fields(OrderState)]
        with transaction.atomic():
            # Touch the row first: the UPDATE takes its lock (SQLite: the write lock), so the read and the
            # change below see no advance in between (one in between would leave a gap clock that is unset).
            if not rows.update(updated_at=timezone.now()):
                return OrderState()
            state = dict(rows.values(*names).get())
            if sequence > state["done"] + 1:
                # Written when the wait starts or a lower waiter shows up, not at every look of one that waits on.
                lowest = min(state["waiting"] or sequence, sequence)
                waiting = {"gap_since": state["gap_since"] or now, "waiting": lowest}
                if waiting != {name: state[name] for name in waiting}:
                    state.update(waiting)
                    rows.update(**waiting)
            elif sequence <= state["done"]:
                state["stale"] += 1
                rows.update(stale=F("stale") + 1)
        return OrderState(**state)

    @translated("advance an ordering key")
    def order_advance(self, key: str, *, sequence: int, now: float, retention: float) -> bool:
        changed = OrderingSequence.objects.filter(key=key, done=sequence - 1).update(
            done=sequence, gap_since=0.0, waiting=0, updated_at=timezone.now()
        )
        return bool(changed)

    @translated("skip a gap of an ordering key")
    def order_skip(self, key: str, *, done: int, to: int, now: float, retention: float) -> bool:
        if to <= done:
            return False
        gap = Case(When(gap_since=0.0, then=Value(now)), default=F("gap_since"), output_field=FloatField())
        changed = OrderingSequence.objects.filter(key=key, done=done).update(
            done=to,
            skipped_from=done + 1,
            skipped_to=to,
            skipped_since=gap,
            skipped_at=now,
            skip_owed=True,
            gap_since=0.0,
            waiting=0,
            updated_at=timezone.now(),
        )
        return bool(changed)

    @translated("record a skipped gap of an ordering key")
    def order_recorded(self, key: str, *, to: int, now: float, retention: float) -> bool:
        changed = OrderingSequence.objects.filter(key=key, skipped_to=to, skip_owed=True).update(
            skip_owed=False, updated_at=timezone.now()
        )
        return bool(changed)

    @translated("alert for an ordering key's wait")
    def order_alert(self, key: str, *, since: float, now: float, retention: float) -> bool:
        changed = (
            OrderingSequence.objects.filter(key=key, gap_since=since)
            .exclude(alerted=since)
            .update(alerted=since, updated_at=timezone.now())
        )
        return bool(changed)

    @translated("read the ordering keys that wait")
    def order_waits(self, *, now: float, limit: int) -> OrderWaits:
        waiting = OrderingSequence.objects.filter(gap_since__gt=0)  # the partial index guardrails_order_waiting
        oldest = tuple(
            OrderWait(key=row["key"], waiting_for=row["done"] + 1, lowest=row["waiting"], since=row["gap_since"])
            for row in waiting.order_by("gap_since").values("key", "done", "waiting", "gap_since")[:limit]
        )
        return OrderWaits(count=waiting.count() if len(oldest) >= limit else len(oldest), oldest=oldest)

    # Waiting messages (celery_guardrails.guardrails.waiting): one row per task id. A note is one INSERT ... ON CONFLICT
    # UPDATE (no lock, no read first: concurrent notes of one task id end as the last one); expired rows are
    # deleted by the read.

    @translated("keep a waiting message")
    def wait_note(self, wait: Wait) -> None:
        values = {name: getattr(wait, name) for name in _WAIT_COPIED}
        row = WaitingMessage(
            **values, due_at=_moment(wait.due), since=_moment(wait.since), expires_at=_moment(wait.expires)
        )
        with transaction.atomic():  # a savepoint inside a caller's transaction: a failed write leaves it usable
            WaitingMessage.objects.bulk_create(
                [row], update_conflicts=True, unique_fields=["task_id"], update_fields=[*_WAIT_COPIED[1:], *_WAIT_TIMES]
            )

    @translated("forget a waiting message")
    def wait_done(self, task_id: str) -> None:
        WaitingMessage.objects.filter(task_id=task_id).delete()

    @translated("read the waiting messages")
    def waiting(self, *, now: float, limit: int, tenants: frozenset[str] | None = None) -> Waits:
        WaitingMessage.objects.filter(expires_at__lte=_moment(now)).delete()
        rows = WaitingMessage.objects.all()
        if tenants is not None:
            rows = rows.filter(tenant__in=sorted(tenants))
        by_reason = {row["reason"]: row["n"] for row in rows.order_by().values("reason").annotate(n=Count("pk"))}
        soonest = tuple(
            Wait(
                **{name: row[name] for name in _WAIT_COPIED},
                due=row["due_at"].timestamp(),
                since=row["since"].timestamp(),
                expires=row["expires_at"].timestamp(),
            )
            for row in rows.order_by("due_at", "task_id").values(*_WAIT_COPIED, *_WAIT_TIMES)[:limit]
        )
        return Waits(count=sum(by_reason.values()), by_reason=by_reason, soonest=soonest)

    # The run ledger: one row per (schedule, period), unique on the pair. Every change is an INSERT the
    # constraint refuses on conflict or one conditional UPDATE, so concurrent beats and workers need no lock;
    # each INSERT runs in a savepoint, so a refused one leaves the caller's transaction usable. Field by field
    # the rules are those of the Redis store's script (celery_guardrails.stores.redis_ledger).

    @staticmethod
    def _ledger(what: str, operation: Callable[[], T]) -> T:
        try:
            return operation()
        except DatabaseError as exc:
            raise failure(what, exc) from exc

    @staticmethod
    def _record(schedule: str, period: float) -> QuerySet[ScheduledRun]:
        return ScheduledRun.objects.filter(schedule=schedule, period=_period(period))

    @staticmethod
    def _insert(schedule: str, period: float, **values: Any) -> bool:
        """Insert the period's record; False when it has one already."""
        try:
            with transaction.atomic():
                ScheduledRun.objects.create(schedule=schedule, period=_period(period), **values)
        except IntegrityError:
            return False
        return True

    @staticmethod
    def _update(records: QuerySet[ScheduledRun], **values: Any) -> bool:
        # QuerySet.update() does not apply auto_now: updated_at is set here.
        return bool(records.update(updated_at=timezone.now(), **values))

    def _upsert(self, schedule: str, period: float, **values: Any) -> None:
        """Update the period's record, else insert it, else (a concurrent insert won) update it after all."""
        records = self._record(schedule, period)
        if not self._update(records, **values) and not self._insert(schedule, period, **values):
            self._update(records, **values)

    def run_dispatch(self, schedule: str, period: float, *, task_id: str, now: float) -> bool:
        values = {"status": DISPATCHED, "task_id": task_id, "dispatched_at": _moment(now)}

        def dispatch() -> bool:
            if self._insert(schedule, period, **values):
                return True
            # A missed period that no message was sent for may be dispatched once (a catch-up): it is open again
            # (no end); the reason it was missed is kept.
            missed = self._record(schedule, period).filter(status=MISSED, task_id="")
            return self._update(missed, finished_at=None, **values)

        return self._ledger(f"dispatch {schedule!r} @ {period}", dispatch)

    def run_undispatch(self, schedule: str, period: float, *, task_id: str) -> bool:
        records = self._record(schedule, period).filter(status=DISPATCHED, task_id=task_id)
        return self._ledger(f"forget the dispatch of {schedule!r} @ {period}", lambda: bool(records.delete()[0]))

    def run_record(self, schedule: str, period: float, *, status: str, now: float, reason: str) -> bool:
        values = {"status": status, "reason": reason[:REASON_MAX_LENGTH], "finished_at": _moment(now)}
        if status == MISSED:
            values["missed_at"] = values["finished_at"]
        return self._ledger(f"record {schedule!r} @ {period}", lambda: self._insert(schedule, period, **values))

    def run_transition(
        self, schedule: str, period: float, *, from_: tuple[str, ...], to: str, now: float, reason: str
    ) -> bool:
        records = self._record(schedule, period).filter(status__in=from_)
        values = {"status": to, "reason": reason[:REASON_MAX_LENGTH]}

        def move() -> bool:
            if to == OVERDUE:  # overdue_at is kept once set: the record says so after the run finishes
                return self._update(records.filter(overdue_at__isnull=True), overdue_at=_moment(now), **values) or (
                    self._update(records, **values)
                )
            if to != MISSED:
                return self._update(records, **values)
            # Reported once: only the update that first sets missed_at answers True; one that moves a period
            # missed before (a lost catch-up) answers False. Each UPDATE is atomic, so of two racing
            # watchdogs one moves the record and the other finds it moved already.
            if self._update(records.filter(missed_at__isnull=True), missed_at=_moment(now), **values):
                return True
            self._update(records, **values)
            return False

        return self._ledger(f"move {schedule!r} @ {period} to {to}", move)

    def run_start(self, schedule: str, period: float, *, task_id: str, now: float) -> None:
        # dispatched_at and reason are kept; a start after an end (a redelivered message) clears the end.
        values = {"status": RUNNING, "task_id": task_id, "started_at": _moment(now), "finished_at": None}
        self._ledger(f"start {schedule!r} @ {period}", lambda: self._upsert(schedule, period, **values))

    def run_finish(self, schedule: str, period: float, *, status: str, now: float, reason: str = "") -> None:
        values: dict[str, Any] = {"status": status, "finished_at": _moment(now)}
        if reason:
            values["reason"] = reason[:REASON_MAX_LENGTH]

        def finish() -> None:
            # No reason keeps the one the record has; a run that was overdue says so first (one UPDATE, from
            # overdue only: a finish delivered twice does not say it twice).
            if not reason:
                was_overdue = self._record(schedule, period).filter(status=OVERDUE)
                if self._update(was_overdue, reason=Concat(Value(WAS_OVERDUE), F("reason")), **values):
                    return
            self._upsert(schedule, period, **values)

        self._ledger(f"finish {schedule!r} @ {period}", finish)

    def run_list(
        self,
        schedule: str,
        *,
        statuses: tuple[str, ...] | None = None,
        before: float | None = None,
        limit: int = 100,
    ) -> list[Run]:
        records = ScheduledRun.objects.of(schedule)
        if statuses is not None:
            records = records.filter(status__in=statuses)
        if before is not None:
            records = records.filter(period__lt=_period(before))
        return self._ledger(
            f"list the runs of {schedule!r}",
            lambda: [_run(row) for row in records.order_by("-period").values(*RUN_FIELDS)[:limit]],
        )

    def run_heads(self, schedules: Iterable[str], *, limit: int = 500) -> dict[str, Heads]:
        names = list(dict.fromkeys(schedules))

        def read() -> dict[str, Heads]:
            newest: dict[str, float] = {}
            pending: dict[str, list[Run]] = {}
            for start in range(0, len(names), HEADS_CHUNK):
                chunk = names[start : start + HEADS_CHUNK]
                newest.update(_newest_periods(chunk))
                records = ScheduledRun.objects.filter(schedule__in=chunk, status__in=(DISPATCHED, RUNNING))
                for row in records.order_by("schedule", "-period").values(*RUN_FIELDS):
                    runs = pending.setdefault(row["schedule"], [])
                    if len(runs) < limit:
                        runs.append(_run(row))
            return {name: Heads(newest_period=newest.get(name), pending=tuple(pending.get(name, ()))) for name in names}

        return self._ledger(f"read the newest runs of {len(names)} schedule(s)", read)

    # Checkpoints of long jobs: one row per job. Saved on the caller's connection, in its transaction (the
    # chunk's ``transaction.atomic()``), so the chunk's effects and its position commit together or not at all.
    # The save is a conditional UPDATE from the expected position (an INSERT for the first, in a savepoint
    # that a concurrent first insert refuses): of two deliveries running one job at once, one moves it.

    @translated("read a checkpoint")
    def load_checkpoint(self, key: str) -> StoredCheckpoint:
        row = Checkpoint.objects.filter(key=key).values_list("position", "state", "completed_at").first()
        if row is None:
            return StoredCheckpoint()
        return StoredCheckpoint(position=int(row[0]), state=row[1], done=row[2] is not None)

    @translated("save a checkpoint")
    def save_checkpoint(self, key: str, *, expected: int, position: int, state: str, ttl: float) -> bool:
        moved = Checkpoint.objects.filter(key=key, position=expected).update(
            position=position, state=state, updated_at=timezone.now()
        )
        if moved or expected != 0:
            return bool(moved)
        try:
            with transaction.atomic():
                Checkpoint.objects.create(key=key, position=position, state=state)
        except IntegrityError:  # another delivery saved first
            return False
        return True

    @translated("complete a checkpoint")
    def complete_checkpoint(self, key: str, *, ttl: float) -> None:
        # Kept until guardrails_prune removes it (updated_at older than idempotency_retention), as a completed key.
        now = timezone.now()
        if not Checkpoint.objects.filter(key=key).update(completed_at=now, updated_at=now):
            Checkpoint.objects.get_or_create(key=key, defaults={"completed_at": now})

    @translated("clear a checkpoint")
    def clear_checkpoint(self, key: str) -> None:
        Checkpoint.objects.filter(key=key).delete()

    # Concurrency slots: every capacity check of a key is one transaction that first bumps the key's row
    # (ConcurrencyKey.checks): an UPDATE, so it takes the row lock on PostgreSQL and the database's write lock
    # on SQLite before anything is read (a SQLite transaction that read first and wrote second could not wait
    # for the lock: it would fail with "database is locked"). Under that lock it reaps the stale holders
    # (marked lost, rows kept), counts the live ones and inserts the new holder: no count is cached anywhere.

    def in_transaction(self) -> bool:
        """Whether this thread is inside a transaction (a slot released there would be rolled back with it)."""
        return bool(connection.in_atomic_block)

    @translated("acquire a concurrency slot")
    def acquire_slot(
        self,
        key: str,
        *,
        holder: str,
        limit: int,
        now: float,
        reap_after: float,
        task_name: str = "",
        task_id: str = "",
        tenant: str = "",
    ) -> SlotAcquisition:
        moment = _moment(now)
        with transaction.atomic():
            _lock_slot_key(key, reap_after=reap_after)
            reaped = _reap(key, now=now, reap_after=reap_after)
            held = ConcurrencySlot.objects.filter(key=key, state=HELD)
            acquired = bool(held.filter(holder=holder).update(heartbeat_at=moment))  # asking again: it holds it
            if not acquired and held.count() < limit:
                ConcurrencySlot.objects.create(
                    key=key,
                    holder=holder,
                    task_name=task_name[:200],
                    task_id=task_id[:255],
                    tenant=tenant[:100],
                    acquired_at=moment,
                    heartbeat_at=moment,
                )
                ConcurrencyKey.objects.filter(key=key).update(acquired=F("acquired") + 1)
                acquired = True
            beats = list(held.order_by("heartbeat_at").values_list("heartbeat_at", flat=True))
        return SlotAcquisition(
            acquired=acquired,
            holders=len(beats),
            reaped=tuple(reaped),
            retry_at=beats[0].timestamp() + reap_after if beats else 0.0,
        )

    @translated("renew a concurrency slot")
    def heartbeat_slot(self, key: str, *, holder: str, now: float) -> bool:
        slot = ConcurrencySlot.objects.filter(key=key, holder=holder, state=HELD)
        if connection.in_atomic_block:
            # The fence inside an effect's transaction: the UPDATE locks the row until that transaction ends, and
            # the reaper skips a locked row, so the slot cannot be taken away under the effect.
            return bool(slot.update(heartbeat_at=_moment(now)))
        with transaction.atomic():
            # The heartbeat thread never waits for a holder's own effect transaction (it beats for every
            # delivery of the process): a row locked by its holder is alive, and is left as it is.
            mine = list(slot.select_for_update(skip_locked=True).values_list("pk", flat=True))
            if mine:
                return bool(ConcurrencySlot.objects.filter(pk__in=mine).update(heartbeat_at=_moment(now)))
        return slot.exists()

    @translated("release a concurrency slot")
    def release_slot(self, key: str, *, holder: str) -> bool:
        deleted, _ = ConcurrencySlot.objects.filter(key=key, holder=holder, state=HELD).delete()
        return bool(deleted)

    @translated("reap concurrency slots")
    def reap_slots(self, *, now: float) -> list[SlotHolder]:
        from django.db.models import Min

        oldest = dict(
            ConcurrencySlot.objects.filter(state=HELD)
            .values("key")
            .annotate(oldest=Min("heartbeat_at"))
            .values_list("key", "oldest")
        )
        ceilings = dict(ConcurrencyKey.objects.filter(key__in=list(oldest)).values_list("key", "reap_after"))
        reaped: list[SlotHolder] = []
        for key, beat in sorted(oldest.items()):
            ceiling = ceilings.get(key, 300.0)
            if beat.timestamp() >= now - ceiling:  # nobody stale here: no lock taken
                continue
            with transaction.atomic():
                _lock_slot_key(key, reap_after=None)
                reaped += _reap(key, now=now, reap_after=ceiling)
        return reaped

    @translated("read a concurrency key")
    def slot_status(self, key: str, *, now: float) -> dict[str, Any]:
        from celery_guardrails.stores.redis_slots import status_of

        row = ConcurrencyKey.objects.filter(key=key).values("reap_after", "checks", "acquired", "reaped").first()
        slots = ConcurrencySlot.objects.filter(key=key)
        holders = [_slot(slot) for slot in slots.filter(state=HELD).order_by("acquired_at")]
        lost = [_slot(slot) for slot in slots.filter(state=LOST).order_by("-reaped_at")[:10]]
        return status_of(key, holders, lost, row or {}, row["reap_after"] if row else None, now)

    # Activity per minute: a batch of counts is one transaction that first records its id (a batch sent again,
    # its answer lost, meets the unique id and adds nothing), then adds each count to its row (an UPDATE, or
    # an INSERT in a savepoint when the row is new; a concurrent first INSERT makes it an UPDATE again).
    # The rows are written in one order, their unique key's, whatever order the process counted them in: each
    # write locks its row until the commit, and two processes flushing the same rows in different orders (a
    # prefork worker's children, each flushing its own counts) would each wait for the other's lock, which
    # PostgreSQL ends with "deadlock detected" and the batch refused (issue #29). In one order, the later
    # flush only waits for the earlier one's commit.

    @translated("add activity counts")
    def activity_add(self, counts: Iterable[OutcomeCount], *, batch: str, retention: float) -> None:
        rows: Counter[tuple[datetime, str, str, str]] = Counter()
        for count in counts:
            if count.count:
                rows[(_moment(count.minute), count.task[:255], count.queue[:255], count.outcome[:40])] += count.count
        if not rows:
            return
        with transaction.atomic():
            try:
                with transaction.atomic():
                    ActivityBatch.objects.create(batch=batch)
            except IntegrityError:
                return  # added before
            for (minute, task_name, queue, outcome), added in sorted(rows.items()):
                match = {"minute": minute, "task_name": task_name, "queue": queue, "outcome": outcome}
                if ActivityCount.objects.filter(**match).update(count=F("count") + added):
                    continue
                try:
                    with transaction.atomic():
                        ActivityCount.objects.create(**match, count=added)
                except IntegrityError:
                    ActivityCount.objects.filter(**match).update(count=F("count") + added)

    @translated("keep queue samples")
    def activity_sample(self, samples: Iterable[QueueSample], *, retention: float) -> None:
        # In one order too (minute, queue), as the counts are.
        with transaction.atomic():
            for sample in sorted(samples, key=lambda sample: (sample.minute, sample.queue[:255])):
                values = {"depth": sample.depth, "oldest_age": sample.oldest_age}
                match = {"minute": _moment(sample.minute), "queue": sample.queue[:255]}
                if QueueSampleRow.objects.filter(**match).update(**values):
                    continue
                try:
                    with transaction.atomic():
                        QueueSampleRow.objects.create(**match, **values)
                except IntegrityError:
                    QueueSampleRow.objects.filter(**match).update(**values)

    @translated("read the activity")
    def activity_read(self, *, since: float, until: float) -> Activity:
        span = {"minute__gte": _moment(since), "minute__lt": _moment(until)}
        outcomes = [
            OutcomeCount(
                minute=row.minute.timestamp(), task=row.task_name, queue=row.queue, outcome=row.outcome, count=row.count
            )
            for row in ActivityCount.objects.filter(**span).order_by("minute", "task_name", "queue", "outcome")
        ]
        queues = [
            QueueSample(minute=row.minute.timestamp(), queue=row.queue, depth=row.depth, oldest_age=row.oldest_age)
            for row in QueueSampleRow.objects.filter(**span).order_by("minute", "queue")
        ]
        return Activity(outcomes=outcomes, queues=queues)


def _lock_slot_key(key: str, *, reap_after: float | None) -> None:
    """Lock ``key``'s row for this transaction (made when missing), counting the check (see DjangoStore)."""
    changes: dict[str, Any] = {"checks": F("checks") + 1}
    if reap_after is not None:
        changes["reap_after"] = reap_after
    if ConcurrencyKey.objects.filter(key=key).update(**changes):
        return
    # The first check of this key: two workers may insert it at once; the loser (which waits for the winner's
    # commit on the unique index) reads it instead, then locks it.
    ConcurrencyKey.objects.get_or_create(key=key, defaults={"reap_after": reap_after or 300.0})
    ConcurrencyKey.objects.filter(key=key).update(**changes)


def _reap(key: str, *, now: float, reap_after: float) -> list[SlotHolder]:
    """Mark lost the holders of ``key`` whose heartbeat is older than ``reap_after`` (under the key's lock).

    A row locked by its holder is skipped: the holder is inside an effect's transaction whose fence renewed
    the heartbeat there (see :func:`celery_guardrails.guardrails.concurrency.fence`), alive for as long as that
    transaction is open (a killed process's connection goes, and its lock with it): a reap never lands in the
    middle of a holder's fenced effect, and never waits for one. (SQLite has no row locks: its one writer at a
    time keeps the reap and the effect apart.)"""
    stale = list(
        ConcurrencySlot.objects.select_for_update(skip_locked=True)
        .filter(key=key, state=HELD, heartbeat_at__lt=_moment(now - reap_after))
        .order_by("heartbeat_at")
    )
    if not stale:
        return []
    moment = _moment(now)
    ConcurrencySlot.objects.filter(pk__in=[slot.pk for slot in stale]).update(state=LOST, reaped_at=moment)
    ConcurrencyKey.objects.filter(key=key).update(reaped=F("reaped") + len(stale))
    return [replace(_slot(slot), reaped_at=now, state=LOST) for slot in stale]


def _slot(slot: ConcurrencySlot) -> SlotHolder:
    return SlotHolder(
        key=slot.key,
        holder=slot.holder,
        task_name=slot.task_name,
        task_id=slot.task_id,
        tenant=slot.tenant,
        acquired_at=slot.acquired_at.timestamp(),
        heartbeat_at=slot.heartbeat_at.timestamp(),
        reaped_at=_seconds(slot.reaped_at),
        state=slot.state,
    )


def _newest_periods(names: list[str]) -> Iterator[tuple[str, float]]:
    """(name, period of its newest record) of each schedule that has one: one index-only probe of the
    (schedule, -period) index per name, driven by the names (a VALUES list: PostgreSQL and SQLite both call its
    column column1). A GROUP BY over the ledger would read every record of every schedule (90 days of them)."""
    quote = connection.ops.quote_name
    table, schedule, period = (quote(name) for name in (ScheduledRun._meta.db_table, "schedule", "period"))
    values = ", ".join(["(%s)"] * len(names))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT wanted.column1, (SELECT {period} FROM {table} WHERE {schedule} = wanted.column1 "
            f"ORDER BY {period} DESC LIMIT 1) FROM (VALUES {values}) AS wanted",
            names,
        )
        for name, newest in cursor.fetchall():
            if newest is not None:
                yield name, _timestamp(newest)


def _timestamp(value: datetime | str) -> float:
    """Epoch seconds of a raw query's timestamp: PostgreSQL's driver gives an aware datetime, SQLite the text
    Django stored (UTC, without its zone: USE_TZ, which the ledger's aware periods need)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value).replace(tzinfo=UTC)
    return value.timestamp()
