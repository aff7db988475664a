"""Idempotency keys in the Django database (the idempotency half of the Django store, mixed in).

One row per key (:class:`~django_celery_guardrails.models.IdempotencyKey`). A claim is an INSERT that inserts
nothing when the key exists (the unique constraint decides); every later change is a conditional UPDATE (only
the current owner, only from the expected state), so two deliveries can never both hold a key. A new key, the
common case, costs one statement to claim and one to complete (in the effect's transaction with
``atomic=True``); statements are written out for these two, where building them through the ORM cost more than
sending them. Retention is enforced by the prune command, not by the database. The publish reservations of
keyed tasks are rows of the same table (``published:<key>``). It mirrors ``RedisIdempotency`` in
``celery_guardrails/stores/redis.py``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from celery_guardrails.exceptions import StoreUnavailableError
from celery_guardrails.stores.base import ACQUIRED, BUSY, COMPLETED, FAILED, Claim

from ..models import IdempotencyKey
from ..signals import drop_broken_connections
from .begin import first_with_begin
from .database import failure, to_datetime, translated


def _quoted(*names: str) -> list[str]:
    return [connection.ops.quote_name(name) for name in (IdempotencyKey._meta.db_table, *names)]


@functools.cache
def _claim_sql(vendor: str, relaxed: bool) -> str:
    """The claim of a new key: one INSERT that inserts nothing when the key exists (PostgreSQL, SQLite).
    ``relaxed`` (PostgreSQL): its commit does not wait for the disk (``synchronous_commit`` off for this
    statement's own transaction; see :meth:`DjangoIdempotency._insert_claim`)."""
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


#: The advisory locks of keys written with their effect: the first of the two keys PostgreSQL's lock takes ("grl"),
#: the second a hash of the scoped key. A hash another key shares only makes one of them wait its turn.
LOCK_SPACE = 0x67726C


@functools.cache
def _with_the_effect_sql(state: str) -> str:
    """A key written as ``state`` inside the caller's transaction, unless another transaction holds its lock
    (then nothing is written; nor when the key exists): one INSERT."""
    table, key, state_column, owner, lease_until, created_at = _quoted(
        "key", "state", "owner", "lease_until", "created_at"
    )
    return (
        f"INSERT INTO {table} ({key}, {state_column}, {owner}, {lease_until}, summary, reason, {created_at}, "
        f"finished_at) SELECT %s, '{state}', %s, NULL, '', %s, %s, %s "
        f"WHERE pg_try_advisory_xact_lock(%s, hashtext(%s)) ON CONFLICT ({key}) DO NOTHING"
    )


class DjangoIdempotency:
    """The idempotency key operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

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
        until = to_datetime(now + lease)
        if self._insert_claim(key, owner=owner, until=until, atomic=atomic):
            return Claim(state=ACQUIRED)
        if self._owned(key, owner).update(lease_until=until):  # this delivery asking again: it holds it
            return Claim(state=ACQUIRED)
        gone = Q(lease_until__lte=to_datetime(now)) | (Q(owner=replaces) if replaces else Q(pk__in=[]))
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

    @contextlib.contextmanager
    def written_with_the_effect(self, key: str, *, owner: str, now: float) -> Iterator[Claim | None]:
        """The body's transaction, its first statement ``key`` written completed by ``owner`` (PostgreSQL, an
        ``atomic`` task: :mod:`celery_guardrails.guardrails.effect_keys`). It commits with the effect or not at
        all, so the key needs no lease and no second write. Yields ACQUIRED (written: run the body inside), BUSY
        (another transaction is writing it now: its transaction-level advisory lock is taken, and this one does
        not wait on the row) or None (the key exists: claim it the usual way). The caller's block ending without
        an error commits. A database error opening the transaction, writing the key or committing is the
        store's (:func:`failure`); one the body raises is its own."""
        stage = "open a transaction for a key"
        try:
            with transaction.atomic():
                stage = "claim a key with its effect"
                claim = self._write(key, "completed", owner=owner, now=now, reason="", opening=True)
                stage = ""
                yield claim
                stage = "commit an effect with its key"
        except DatabaseError as exc:
            if not stage:  # the body's own database error: classified like any other failure
                raise
            error = failure(stage, exc)
            if isinstance(error, StoreUnavailableError):
                drop_broken_connections()
            raise error from exc

    @translated("fail a key written with its effect")
    def fail_with_the_effect(self, key: str, *, owner: str, now: float, reason: str) -> bool:
        """A key claimed with its effect whose body failed for good: the effect and the key were rolled back
        together, so the key is written failed now (as a claim made apart would have been marked). False when a
        row is there already (another delivery wrote it) or another transaction is writing it."""
        claim = self._write(key, "failed", owner=owner, now=now, reason=reason[:200])
        return claim is not None and claim.state == ACQUIRED

    def _write(
        self, key: str, state: str, *, owner: str, now: float, reason: str, opening: bool = False
    ) -> Claim | None:
        """``key`` written as ``state`` (see :func:`_with_the_effect_sql`); ``opening``: the first statement of the
        transaction the caller just opened, sent with its BEGIN where it can be (:mod:`.begin`)."""
        moment = connection.ops.adapt_datetimefield_value(to_datetime(now))
        params = [key, owner, reason, moment, moment, LOCK_SPACE, key]
        written = first_with_begin(_with_the_effect_sql(state), params) if opening else None
        if written == 1:
            return Claim(state=ACQUIRED)
        with connection.cursor() as cursor:
            if written is None:  # not sent with the BEGIN: sent now
                cursor.execute(_with_the_effect_sql(state), params)
                if cursor.rowcount == 1:
                    return Claim(state=ACQUIRED)
            # Nothing written: the lock was another transaction's, or the key exists (a lock this transaction
            # took is taken again: advisory locks count per session). Asked apart: the uncommon case.
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", [LOCK_SPACE, key])
            (taken,) = cursor.fetchone()
        return None if taken else Claim(state=BUSY, lease_until=now)

    def _owned(self, key: str, owner: str) -> Any:
        return IdempotencyKey.objects.filter(key=key, owner=owner, state="claimed")

    @translated("extend a lease")
    def extend(self, key: str, *, owner: str, now: float, lease: float) -> bool:
        return bool(self._owned(key, owner).update(lease_until=to_datetime(now + lease)))

    @translated("finish a key")
    def _finish(self, key: str, owner: str, state: str, *, text: str, value: str, now: float) -> bool:
        finished_at = connection.ops.adapt_datetimefield_value(to_datetime(now))
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
