"""The admin dashboard: the numbers of ``celery guardrails status`` and the last 24 hours of dead letters.

The numbers are :func:`celery_guardrails.operations.status.gather`'s (queues with depth and oldest age, open dead
letters
by owner, dependencies, schedule health), read when the page is shown; a source that cannot be read is named.
The chart is dead letters per hour of their last failure over the last 24 hours, stacked by reason (the
:data:`TOP_REASONS` most frequent, the rest as "other"), drawn server-side as SVG: one grouped query on an
indexed column, whatever the number of records.

Below it, from the activity the workers keep in the store (:mod:`celery_guardrails.operations.activity`, the
``activity``
option): for each of the :data:`TOP_SERIES` busiest tasks, its deliveries per hour stacked by outcome; for each
of the :data:`TOP_SERIES` queues whose oldest message was oldest, the largest age sampled in each hour (an hour
without a known age draws no bar: RabbitMQ gives no age, see :mod:`celery_guardrails.broker.queues`). One read of the
store for the day. Every chart is drawn server-side as SVG: no script, no chart library.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .display import escape, moment
from .models import DeadLetter
from .overview import HOURS
from .scoping import HIDDEN, scope, sees_all, status_for

TOP_REASONS = 5
OTHER = "other"
#: Bar colours, one per reason in order (then "other"): distinct, readable on the admin's light and dark themes.
PALETTE = ("#417690", "#e07b39", "#79aec8", "#c0392b", "#8e6bbf", "#999999")
#: The chart's size in SVG user units (it scales to the page's width). Its legend is HTML below it: the page
#: lays the names out and wraps them (names in SVG at fixed places overlapped: ``retry_budget_exhausted``).
WIDTH, HEIGHT = 720, 160
#: What an empty chart says, in its middle and in place of its tallest bar (an empty chart once read
#: "tallest bar: 1.0 s", a bar that did not exist).
NO_DATA = "no data in this window"


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


def dead_letters_by_reason(*, now: datetime | None = None, user: Any = None) -> ReasonHours:
    current = (now or timezone.now()).replace(minute=0, second=0, microsecond=0)
    first = current - timedelta(hours=HOURS - 1)
    rows = list(
        scope(DeadLetter.objects.filter(last_failed_at__gte=first), user)
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
    """The dead letters' stacked bar chart as inline SVG (escaped text, a title per bar for its counts)."""
    colours = {reason: _colour(position, reason) for position, reason in enumerate(hours.reasons)}
    return stacked_chart(
        "dl-reasons-chart",
        f"Dead letters per hour over the last {HOURS} hours, by reason",
        [_moment(start) for start in hours.starts],
        colours,
        [{reason: float(n) for reason, n in hour.items()} for hour in hours.counts],
    )


def _colour(position: int, name: str) -> str:
    return PALETTE[-1] if name == OTHER else PALETTE[min(position, len(PALETTE) - 2)]


def _moment(start: datetime | float) -> datetime:
    return start if isinstance(start, datetime) else datetime.fromtimestamp(start, UTC)


def _amount(value: float, unit: str) -> str:
    return f"{value:.0f}" if not unit else f"{value:.1f} {unit}"


def stacked_chart(
    chart_id: str,
    label: str,
    starts: list[datetime],
    colours: dict[str, str],
    bars: list[dict[str, float]],
    *,
    unit: str = "",
    height: int = HEIGHT,
    unknown: str = "none",
) -> SafeString:
    """A bar per hour of ``starts``, its series stacked in the order of ``colours`` (series -> colour), with a
    legend; each bar's title gives its hour and values (``unknown`` for an empty hour). Server-side SVG and an
    HTML legend: no script, every text escaped, control and invisible characters written out (:mod:`.display`)."""
    highest = max((sum(hour.values()) for hour in bars), default=0.0)
    peak = highest or 1.0  # the bars' scale (no bar when nothing is there)
    step = WIDTH / max(1, len(starts))
    rects = []
    for index, (start, hour) in enumerate(zip(starts, bars, strict=True)):
        base = float(height)
        title = escape(
            ", ".join(f"{name} {_amount(hour[name], unit)}" for name in colours if hour.get(name)) or unknown
        )
        if not any(hour.get(name) for name in colours):  # an empty hour still says what it holds, on hover
            rects.append(
                format_html(
                    '<rect x="{}" y="0" width="{}" height="{}" fill="transparent" class="gr-empty">'
                    "<title>{}: {}</title></rect>",
                    f"{index * step + 1:.1f}",
                    f"{step - 2:.1f}",
                    height,
                    moment(start),  # the hour's start, as every page writes a moment
                    title,
                )
            )
        for name, colour in colours.items():
            value = hour.get(name, 0.0)
            if not value:
                continue
            size = height * value / peak
            base -= size
            rects.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}" data-series="{}" data-value="{}">'
                    "<title>{}: {}</title></rect>",
                    f"{index * step + 1:.1f}",
                    f"{base:.1f}",
                    f"{step - 2:.1f}",
                    f"{size:.1f}",
                    colour,
                    escape(name),
                    f"{value:g}",
                    moment(start),  # the hour's start, as every page writes a moment
                    title,
                )
            )
    if not highest:  # said in the chart itself, not only in its legend
        rects.append(
            format_html(
                '<text x="{}" y="{}" text-anchor="middle" dominant-baseline="middle" class="gr-no-data">{}</text>',
                WIDTH // 2,
                height // 2,
                NO_DATA,
            )
        )
    # Each name whole on hover too (the page wraps a long one, never lays it over the next)
    legend = format_html_join(
        "",
        '<li data-legend="{}" title="{}"><span class="gr-swatch" style="background: {}"></span>{}</li>',
        ((escape(name), escape(name), colour, escape(name, html=True)) for name, colour in colours.items()),
    )
    peak_text = f"tallest bar: {_amount(highest, unit)}" if highest else NO_DATA
    return format_html(
        '<div class="gr-figure"><svg id="{}" class="gr-chart" viewBox="0 0 {} {}" width="100%" role="img" '
        'aria-label="{}">{}</svg><ul class="gr-legend">{}<li class="gr-peak">{}</li></ul></div>',
        chart_id,
        WIDTH,
        height,
        escape(label),
        SafeString("".join(rects)),
        legend,
        peak_text,
    )


#: Colours of the delivery outcomes (see celery_guardrails.operations.metrics), in stacking order: good at the bottom.
OUTCOME_COLOURS = {
    "succeeded": "#417690",
    "skipped": "#79aec8",
    "duplicate_skipped": "#a8cfe0",
    "retry_later": "#c9b458",
    "deferred_budget": "#e0a839",
    "deferred_circuit": "#e07b39",
    "retried": "#d35400",
    "failed": "#8e6bbf",
    "dead_lettered": "#c0392b",
}
#: Tasks and queues charted at most (the busiest; the page says how many more there are).
TOP_SERIES = 6
SMALL_HEIGHT = 70


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivityCharts:
    """The activity charts of the last :data:`HOURS` hours: one per task (outcomes) and per queue (oldest age)."""

    starts: list[datetime]
    #: (task, total deliveries, chart), the busiest first.
    tasks: list[tuple[str, int, SafeString]]
    more_tasks: int
    #: (queue, largest age sampled, chart), the oldest first.
    queues: list[tuple[str, float, SafeString]]
    more_queues: int
    #: Why the activity could not be read ("" when it was), or that it is off.
    error: str = ""


def activity_charts(app: Any, *, now: datetime | None = None) -> ActivityCharts:
    """Outcomes per task and queue age per hour, from the activity the workers keep in the store."""
    from celery_guardrails.foundation import clock
    from celery_guardrails.operations import activity
    from celery_guardrails.operations.status import attempt

    # The activity's minutes are on the app's clock (the clock option; time.time unless a demo or a test sets it)
    current = now.timestamp() if now is not None else clock.now(app)
    starts = activity.hour_starts(current, HOURS)
    moments = [_moment(start) for start in starts]
    empty = ActivityCharts(starts=moments, tasks=[], more_tasks=0, queues=[], more_queues=0)
    if not activity.enabled(app):
        return replace(empty, error="the activity option is off: nothing is kept")
    errors: dict[str, str] = {}
    found = attempt("activity", lambda: activity.read(app, since=starts[0], until=starts[-1] + 3600), errors)
    if found is None:
        return replace(empty, error=errors["activity"])
    per_task = activity.hourly_outcomes(found, starts)
    totals = sorted(((sum(sum(h.values()) for h in hours), task) for task, hours in per_task.items()), reverse=True)
    tasks = []
    for index, (total, task) in enumerate(totals[:TOP_SERIES]):
        seen = {outcome for hour in per_task[task] for outcome in hour}
        colours = {o: c for o, c in OUTCOME_COLOURS.items() if o in seen}
        colours.update({o: PALETTE[-1] for o in sorted(seen - set(OUTCOME_COLOURS))})
        bars = [{o: float(n) for o, n in hour.items()} for hour in per_task[task]]
        label = f"Deliveries of {task} per hour over the last {HOURS} hours, by outcome"
        tasks.append(
            (task, total, stacked_chart(f"outcomes-chart-{index}", label, moments, colours, bars, height=SMALL_HEIGHT))
        )
    per_queue = activity.hourly_queue_ages(found, starts)
    oldest = sorted(
        ((max((a for a in ages if a is not None), default=0.0), q) for q, ages in per_queue.items()), reverse=True
    )
    queues = []
    for index, (age, queue) in enumerate(oldest[:TOP_SERIES]):
        bars = [{"oldest age": age} if age else {} for age in per_queue[queue]]
        label = f"Largest age of the oldest message of {queue} per hour over the last {HOURS} hours"
        queues.append(
            (
                queue,
                age,
                stacked_chart(
                    f"queue-age-chart-{index}",
                    label,
                    moments,
                    {"oldest age": PALETTE[0]},
                    bars,
                    unit="s",
                    height=SMALL_HEIGHT,
                    unknown="no known age",
                ),
            )
        )
    return ActivityCharts(
        starts=moments,
        tasks=tasks,
        more_tasks=max(0, len(totals) - TOP_SERIES),
        queues=queues,
        more_queues=max(0, len(oldest) - TOP_SERIES),
    )


def dashboard_context(app: Any, *, now: datetime | None = None, user: Any = None) -> dict[str, Any]:
    """What the page shows (see the module docstring), of the tenants ``user`` may see (:mod:`.scoping`)."""
    status = status_for(app, user)
    hours = dead_letters_by_reason(now=now, user=user)
    return {
        "status": status,
        "owners": status.dead_letters.by_owner(),
        "hours": hours,
        "chart": chart(hours),
        "queue_rows": [(queue, (status.rates or {}).get(queue.queue)) for queue in status.queues],
        "activity": activity_charts(app, now=now)
        if sees_all(user)
        else ActivityCharts(starts=[], tasks=[], more_tasks=0, queues=[], more_queues=0, error=HIDDEN),
    }
