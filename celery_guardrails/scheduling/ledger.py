"""The run ledger: one durable record per (schedule, period) of scheduled work.

A *period* is named by its due instant (epoch seconds, UTC): the run due at 02:30 covers the period that
ends at 02:30. The store keeps one record per ``(schedule, period)`` and refuses a second one, so two beat
processes, a manual re-run and a catch-up cannot dispatch the same period twice. The Django store keeps
records in the ``guardrails.ScheduledRun`` table (unique on the pair); the Redis store keeps them in one
hash per schedule, changed by Lua scripts (see :mod:`celery_guardrails.stores.redis`).

Statuses and who sets them::

    dispatched       beat published the period's message (run_dispatch; forgotten again by run_undispatch
                     when the publish failed, so the period is due again)
    running          a worker started it (run_start)
    ok / failed      it finished (run_finish)
    skipped_overlap  its predecessor was still running and overlap="skip" (run_finish)
    skipped_disabled its schedule (a django-celery-beat row) was disabled when it came due (beat or the
                     watchdog: run_record); re-enabled, the schedule goes on from the next period
    missed           beat did not dispatch it within grace, or it was not started within grace
                     (the watchdog, or beat's catch-up: run_record / run_transition)
    overdue          it started and ran past max_runtime (the watchdog: run_transition); it keeps
                     ``overdue_at`` when it finishes, and its reason says it was overdue

A record moves on only through these operations, each atomic in the store. A ``missed`` record that no
message was sent for (``task_id`` empty) may still be dispatched once by a catch-up policy.

A period is reported missed once (``run_missed`` and the owner's alert), by whichever beat, watchdog or
command made the change that first set its ``missed_at``: the insert of a missed record, or the conditional
update that moved it to missed. A catch-up dispatch of a missed period that is then lost too moves the
record to missed again, without a second report (the owner already knows the period did not run).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

DISPATCHED = "dispatched"
RUNNING = "running"
OK = "ok"
FAILED = "failed"
SKIPPED_OVERLAP = "skipped_overlap"
SKIPPED_DISABLED = "skipped_disabled"
MISSED = "missed"
OVERDUE = "overdue"

#: Every status, in the order the admin lists them.
STATUSES = (DISPATCHED, RUNNING, OK, FAILED, SKIPPED_OVERLAP, SKIPPED_DISABLED, MISSED, OVERDUE)
#: Statuses of a record whose run has not ended.
OPEN = (DISPATCHED, RUNNING, OVERDUE)
#: What a finished run's reason starts with when it had been overdue.
WAS_OVERDUE = "finished after being overdue: "
#: Longest reason kept on a record.
REASON_MAX_LENGTH = 500
#: Seconds a record is kept (90 days): the Redis store drops older ones as it writes, the Django app's
#: prune command deletes them.
RETENTION = 90 * 24 * 3600.0
#: Longest schedule name (a django-celery-beat PeriodicTask name is at most 200 characters).
NAME_MAX_LENGTH = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One ledger record. Times are epoch seconds (None: not yet)."""

    schedule: str
    period: float
    status: str
    task_id: str = ""
    dispatched_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    reason: str = ""
    #: When the period was first recorded missed (it stays set through a catch-up and its run).
    missed_at: float | None = None
    #: When the run was first recorded overdue (it stays set once the run finishes).
    overdue_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heads:
    """What the watchdog reads of one schedule: the period of its newest record (None: it has none) and its
    records still dispatched or running, newest period first."""

    newest_period: float | None = None
    pending: tuple[Run, ...] = ()


def period_key(schedule: str, period: float) -> str:
    """The idempotency key of one period: ``<schedule, percent-quoted>@<due instant, epoch seconds>``.

    Quoted so that a name with spaces (common for django-celery-beat rows) still makes a valid key.
    """
    return f"{quote(schedule, safe='')}@{period:.0f}"


class RunLedger(Protocol):
    """The ledger operations every store provides (each atomic; ``now`` is epoch seconds)."""

    def run_dispatch(self, schedule: str, period: float, *, task_id: str, now: float) -> bool:
        """Record the period as dispatched with ``task_id``; False when it is recorded already (another
        beat, an earlier dispatch). A ``missed`` record without a task id is taken (a catch-up)."""
        ...

    def run_undispatch(self, schedule: str, period: float, *, task_id: str) -> bool:
        """Forget a dispatch whose message could not be published (the record of ``task_id``, still
        ``dispatched``), so that the period is due again; whether it did."""
        ...

    def run_record(self, schedule: str, period: float, *, status: str, now: float, reason: str) -> bool:
        """Insert a record with ``status`` (missed, skipped_overlap) unless the period has one; whether it did.
        Its ``finished_at`` is ``now``: when the decision was recorded (and its ``missed_at``, if missed)."""
        ...

    def run_transition(
        self, schedule: str, period: float, *, from_: tuple[str, ...], to: str, now: float, reason: str
    ) -> bool:
        """Move the record from one of ``from_`` to ``to``; whether this call moved it.

        Moving to ``missed`` sets ``missed_at`` unless the period was missed before; True only when it was
        not (the call that may report the period missed): a period moved to missed again answers False."""
        ...

    def run_start(self, schedule: str, period: float, *, task_id: str, now: float) -> None:
        """Mark the period running (creating its record if a message arrived without one)."""
        ...

    def run_finish(self, schedule: str, period: float, *, status: str, now: float, reason: str = "") -> None:
        """Mark the period finished with ``status`` (ok, failed, skipped_overlap)."""
        ...

    def run_list(
        self,
        schedule: str,
        *,
        statuses: tuple[str, ...] | None = None,
        before: float | None = None,
        limit: int = 100,
    ) -> list[Run]:
        """Records of ``schedule``, newest period first: only ``statuses`` if given, periods < ``before``."""
        ...

    def run_heads(self, schedules: Iterable[str], *, limit: int = 500) -> dict[str, Heads]:
        """:class:`Heads` of each of ``schedules`` (its records still dispatched or running: at most ``limit``):
        the watchdog's one read of a check. The Django store reads them in a few queries whatever the number of
        schedules (two per 500 schedules); the Redis store two round trips a schedule."""
        ...
