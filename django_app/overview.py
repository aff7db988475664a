"""The dead-letter overview: what is open, grouped by cause, reason, owner and task, and the last 24 hours by hour.

Read by the admin's overview page (``DeadLetterAdmin``, ``overview/``) and ``guardrails_deadletters causes``. Five
grouped queries on indexed columns (status, fingerprint, reason, owner, task name, last failure), whatever the
number of records, and one index probe per cause shown for its newest record (what names it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Min
from django.db.models.functions import TruncHour
from django.utils import timezone

from celery_guardrails.foundation.fingerprints import normalised, own_frame

from .models import DeadLetter
from .scoping import scope

#: Rows shown per grouping (the biggest first).
TOP = 20
#: Hours the chart covers.
HOURS = 24


@dataclass(frozen=True, slots=True)
class Group:
    value: str
    count: int
    #: Share of the biggest group, 0 to 100 (the width of its bar).
    share: int


@dataclass(frozen=True, slots=True)
class Hour:
    start: datetime
    count: int
    share: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    """Open records of one cause (:mod:`celery_guardrails.foundation.fingerprints`), named by its newest one."""

    fingerprint: str
    count: int
    first_seen: datetime
    last_seen: datetime
    task_name: str
    #: The cause in words (:func:`described`): ``PermanentError in shop/tasks.py:charge: order <n> declined``.
    title: str
    share: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Overview:
    open_count: int
    #: The biggest causes of open records; records made before fingerprints are in ``unsorted_count``.
    by_cause: list[Cause]
    unsorted_count: int
    by_reason: list[Group]
    by_owner: list[Group]
    by_task: list[Group]
    #: Records that failed in each of the last HOURS hours (any status), oldest first.
    hours: list[Hour]
    last_day_count: int


def _groups(field: str, user: Any) -> list[Group]:
    rows = list(
        scope(DeadLetter.objects.open(), user)
        .order_by()
        .values(field)
        .annotate(count=Count("pk"))
        .order_by("-count", field)[:TOP]
    )
    top = max((row["count"] for row in rows), default=1)
    return [Group(value=row[field] or "-", count=row["count"], share=round(100 * row["count"] / top)) for row in rows]


def causes(*, user: Any = None, limit: int = TOP) -> list[Cause]:
    """The ``limit`` biggest causes of the open records ``user`` may see, with their first and last failure."""
    rows = list(
        scope(DeadLetter.objects.open(), user)
        .exclude(fingerprint="")
        .order_by()
        .values("fingerprint")
        .annotate(count=Count("pk"), first_seen=Min("first_failed_at"), last_seen=Max("last_failed_at"))
        .order_by("-count", "fingerprint")[:limit]
    )
    top = max((row["count"] for row in rows), default=1)
    found = []
    for row in rows:
        newest = newest_of_cause(row["fingerprint"], user=user)
        found.append(
            Cause(
                fingerprint=row["fingerprint"],
                count=row["count"],
                first_seen=row["first_seen"],
                last_seen=row["last_seen"],
                task_name=newest["task_name"] if newest else "",
                title=described(newest) if newest else row["fingerprint"],
                share=round(100 * row["count"] / top),
            )
        )
    return found


def newest_of_cause(fingerprint: str, *, user: Any = None) -> dict[str, Any] | None:
    """The newest record of a cause that ``user`` may see (its task, exception and traceback), or None."""
    return (
        scope(DeadLetter.objects.filter(fingerprint=fingerprint), user)
        .order_by("-last_failed_at")
        .values("task_name", "exc_type", "exc_message", "traceback")
        .first()
    )


def cause_title(fingerprint: str, *, user: Any = None) -> str:
    """What a cause is, as the overview names it, for a filter's label; the fingerprint itself when no record of
    it is in sight."""
    newest = newest_of_cause(fingerprint, user=user)
    if newest is None:
        return fingerprint
    return described(newest)


def described(record: Mapping[str, Any]) -> str:
    """A record's cause in words (its exception type, the frame of its task's own code, its normalised message):
    every record of one cause reads the same, as the fingerprint is made of these."""
    frame = own_frame(record["task_name"], record["traceback"])
    where = f" in {frame}" if frame else ""
    return f"{record['exc_type'] or 'no exception'}{where}: {normalised(record['exc_message'])[:120]}"


def dead_letter_overview(*, now: datetime | None = None, user: Any = None) -> Overview:
    """The overview of the records ``user`` may see (:mod:`.scoping`; every record for None)."""
    current = (now or timezone.now()).replace(minute=0, second=0, microsecond=0)
    first = current - timedelta(hours=HOURS - 1)
    counted = {
        row["hour"]: row["count"]
        for row in scope(DeadLetter.objects.filter(last_failed_at__gte=first), user)
        .order_by()
        .annotate(hour=TruncHour("last_failed_at"))
        .values("hour")
        .annotate(count=Count("pk"))
    }
    starts = [first + timedelta(hours=k) for k in range(HOURS)]
    counts = [sum(n for hour, n in counted.items() if start <= hour < start + timedelta(hours=1)) for start in starts]
    top = max(counts, default=0) or 1
    return Overview(
        open_count=scope(DeadLetter.objects.open(), user).count(),
        by_cause=causes(user=user),
        unsorted_count=scope(DeadLetter.objects.open().filter(fingerprint=""), user).count(),
        by_reason=_groups("reason", user),
        by_owner=_groups("owner", user),
        by_task=_groups("task_name", user),
        hours=[Hour(start=start, count=n, share=round(100 * n / top)) for start, n in zip(starts, counts, strict=True)],
        last_day_count=sum(counts),
    )
