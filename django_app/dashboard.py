"""The admin dashboard: the numbers of ``celery guardrails status`` and the last 24 hours of dead letters.

The numbers are :func:`celery_guardrails.status.gather`'s (queues with depth and oldest age, open dead letters
by owner, dependencies, schedule health), read when the page is shown; a source that cannot be read is named.
The chart is dead letters per hour of their last failure over the last 24 hours, stacked by reason (the
:data:`TOP_REASONS` most frequent, the rest as "other"), drawn server-side as SVG: one grouped query on an
indexed column, whatever the number of records. (Charts of outcomes per task and of queue age over time need a
history the stores do not keep yet.)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .models import DeadLetter
from .overview import HOURS

TOP_REASONS = 5
OTHER = "other"
#: Bar colours, one per reason in order (then "other"): distinct, readable on the admin's light and dark themes.
PALETTE = ("#417690", "#e07b39", "#79aec8", "#c0392b", "#8e6bbf", "#999999")
#: The chart's size in SVG user units (it scales to the page's width).
WIDTH, HEIGHT, LEGEND = 720, 160, 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasonHours:
    """Dead letters per hour (oldest first) and per reason, over the last :data:`HOURS` hours."""

    starts: list[datetime]
    reasons: list[str]
    #: counts[i][reason]: records whose last failure fell in hour i, for that reason.
    counts: list[dict[str, int]]

    @property
    def total(self) -> int:
        return sum(sum(hour.values()) for hour in self.counts)


def dead_letters_by_reason(*, now: datetime | None = None) -> ReasonHours:
    current = (now or timezone.now()).replace(minute=0, second=0, microsecond=0)
    first = current - timedelta(hours=HOURS - 1)
    rows = list(
        DeadLetter.objects.filter(last_failed_at__gte=first)
        .order_by()
        .annotate(hour=TruncHour("last_failed_at"))
        .values("hour", "reason")
        .annotate(count=Count("pk"))
    )
    totals: Counter[str] = Counter()
    for row in rows:
        totals[row["reason"]] += row["count"]
    top = [reason for reason, _ in sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:TOP_REASONS]]
    starts = [first + timedelta(hours=k) for k in range(HOURS)]
    counts: list[dict[str, int]] = [{} for _ in starts]
    for row in rows:
        # TruncHour gives the hour in the current time zone: place it by instant, not by position
        index = int((row["hour"] - first).total_seconds() // 3600)
        if 0 <= index < HOURS:
            reason = row["reason"] if row["reason"] in top else OTHER
            counts[index][reason] = counts[index].get(reason, 0) + row["count"]
    reasons = top + ([OTHER] if any(OTHER in hour for hour in counts) else [])
    return ReasonHours(starts=starts, reasons=reasons, counts=counts)


def chart(hours: ReasonHours) -> SafeString:
    """The stacked bar chart as inline SVG (escaped text, a title per bar for its counts)."""
    peak = max((sum(hour.values()) for hour in hours.counts), default=0) or 1
    step = WIDTH / HOURS
    bars = []
    for index, (start, hour) in enumerate(zip(hours.starts, hours.counts, strict=True)):
        base = float(HEIGHT)
        label = ", ".join(f"{reason} {hour[reason]}" for reason in hours.reasons if hour.get(reason)) or "none"
        for position, reason in enumerate(hours.reasons):
            count = hour.get(reason, 0)
            if not count:
                continue
            height = HEIGHT * count / peak
            base -= height
            bars.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}" data-reason="{}"'
                    ' data-count="{}"><title>{}: {}</title></rect>',
                    f"{index * step + 1:.1f}",
                    f"{base:.1f}",
                    f"{step - 2:.1f}",
                    f"{height:.1f}",
                    PALETTE[min(position, len(PALETTE) - 1)] if reason != OTHER else PALETTE[-1],
                    reason,
                    count,
                    timezone.localtime(start).strftime("%Y-%m-%d %H:00"),
                    label,
                )
            )
    legend = format_html_join(
        "",
        '<rect x="{}" y="{}" width="10" height="10" fill="{}"></rect><text x="{}" y="{}" font-size="11">{}</text>',
        (
            (
                position * 120,
                HEIGHT + 6,
                PALETTE[min(position, len(PALETTE) - 1)] if reason != OTHER else PALETTE[-1],
                position * 120 + 14,
                HEIGHT + 15,
                reason,
            )
            for position, reason in enumerate(hours.reasons)
        ),
    )
    return format_html(
        '<svg id="dl-reasons-chart" viewBox="0 0 {} {}" width="100%" role="img" aria-label="{}">{}{}</svg>',
        WIDTH,
        HEIGHT + LEGEND,
        f"Dead letters per hour over the last {HOURS} hours, by reason",
        SafeString("".join(bars)),
        legend,
    )


def dashboard_context(app: Any, *, now: datetime | None = None) -> dict[str, Any]:
    """What the page shows (see the module docstring)."""
    from celery_guardrails.status import gather

    status = gather(app)
    hours = dead_letters_by_reason(now=now)
    return {"status": status, "owners": status.dead_letters.by_owner(), "hours": hours, "chart": chart(hours)}
