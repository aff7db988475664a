"""Concurrency slots in the Django database (the slot half of the Django store, mixed in; see
:mod:`celery_guardrails.guardrails.concurrency`).

One row per key (:class:`~django_celery_guardrails.models.ConcurrencyKey`: its counters and the lock) and one
per holder (:class:`~django_celery_guardrails.models.ConcurrencySlot`; a reaped holder's row is kept, marked
lost). Every capacity check of a key is one transaction that first bumps the key's row (``checks``): an UPDATE,
so it takes the row lock on PostgreSQL and the database's write lock on SQLite before anything is read (a SQLite
transaction that read first and wrote second could not wait for the lock: it would fail with "database is
locked"). Under that lock it reaps the stale holders (marked lost, rows kept), counts the live ones and inserts
the new holder: no count is cached anywhere. It mirrors ``celery_guardrails/stores/redis_slots.py``, whose
status report it shares.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Min

from celery_guardrails.stores.base import HELD, LOST, SlotAcquisition, SlotHolder
from celery_guardrails.stores.redis_slots import status_of

from ..models import ConcurrencyKey, ConcurrencySlot
from .database import to_datetime, to_seconds, translated


class DjangoSlots:
    """The concurrency slot operations of :class:`~django_celery_guardrails.store.DjangoStore` (mixed in)."""

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
        moment = to_datetime(now)
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
            return bool(slot.update(heartbeat_at=to_datetime(now)))
        with transaction.atomic():
            # The heartbeat thread never waits for a holder's own effect transaction (it beats for every
            # delivery of the process): a row locked by its holder is alive, and is left as it is.
            mine = list(slot.select_for_update(skip_locked=True).values_list("pk", flat=True))
            if mine:
                return bool(ConcurrencySlot.objects.filter(pk__in=mine).update(heartbeat_at=to_datetime(now)))
        return slot.exists()

    @translated("release a concurrency slot")
    def release_slot(self, key: str, *, holder: str) -> bool:
        deleted, _ = ConcurrencySlot.objects.filter(key=key, holder=holder, state=HELD).delete()
        return bool(deleted)

    @translated("reap concurrency slots")
    def reap_slots(self, *, now: float) -> list[SlotHolder]:
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
        row = ConcurrencyKey.objects.filter(key=key).values("reap_after", "checks", "acquired", "reaped").first()
        slots = ConcurrencySlot.objects.filter(key=key)
        holders = [_slot(slot) for slot in slots.filter(state=HELD).order_by("acquired_at")]
        lost = [_slot(slot) for slot in slots.filter(state=LOST).order_by("-reaped_at")[:10]]
        return status_of(key, holders, lost, row or {}, row["reap_after"] if row else None, now)


def _lock_slot_key(key: str, *, reap_after: float | None) -> None:
    """Lock ``key``'s row for this transaction (made when missing), counting the check (see the module's docstring)."""
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
        .filter(key=key, state=HELD, heartbeat_at__lt=to_datetime(now - reap_after))
        .order_by("heartbeat_at")
    )
    if not stale:
        return []
    moment = to_datetime(now)
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
        reaped_at=to_seconds(slot.reaped_at),
        state=slot.state,
    )
