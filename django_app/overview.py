"""The dead-letter overview: what is open, grouped by reason, owner and task, and the last 24 hours by hour.

Read by the admin's overview page (``DeadLetterAdmin``, ``overview/``). Four grouped queries on indexed columns
(status, reason, owner, task name, last failure), whatever the number of records.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.utils import timezone

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
class Overview:
    open_count: int
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
        by_reason=_groups("reason", user),
        by_owner=_groups("owner", user),
        by_task=_groups("task_name", user),
        hours=[Hour(start=start, count=n, share=round(100 * n / top)) for start, n in zip(starts, counts, strict=True)],
        last_day_count=sum(counts),
    )
