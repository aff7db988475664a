"""What ``celery -A proj guardrails status`` shows and the metrics collector exports, read at the time asked.

Each source is read on its own (:func:`read_dead_letters`, :func:`read_dependencies`, :func:`read_schedules`,
:func:`celery_guardrails.broker.queues.read_queues` and :func:`celery_guardrails.operations.activity.rates`);
:func:`gather`
reads them all into one :class:`Status`, in which a source that could not be read (its store or broker down) is
named in ``errors`` with the reason, and the others are there: a status read never raises for a source.
:func:`render` writes it as a table, :func:`as_json` as JSON.

Where each comes from:

* rates in and out per queue (with the ``activity`` option, its default): deliveries that ended per minute over
  the last :data:`RATE_MINUTES` whole minutes, from the outcome counts the workers keep in the store, and
  arrivals derived as those plus the depth's change between the first and last queue samples of the window
  (a broker counts no arrivals); "?" until two samples are kept.
* messages waiting for a countdown (when the app has a guarded task): re-published by a retry, a
  retry-budget or circuit deferral, a wait for a concurrency slot, an ordering turn, a busy key or a store
  outage, and not in any queue until the broker delivers them again: how many per reason, and the
  :data:`WAITING_SHOWN` soonest due (task, id, tenant, reason, attempt, due, since when), from the store's rows
  (see :mod:`celery_guardrails.guardrails.waiting`).
* the transactional outbox (with the Django app): messages waiting for the relay and the age of the oldest.
* dead letters still open, per owner and task: the app's dead-letter sinks
  (:func:`celery_guardrails.runtime.dead_letters.sinks_for`). The Django sink: ``DeadLetter`` rows with status
  ``open``, counted by the database. The Redis stream sink keeps no status (nothing closes a stream entry):
  every entry counts as open, and only the newest :data:`STREAM_SCAN` entries are read (``truncated`` says
  when the stream holds more).
* retry budget and circuit per dependency: the ``dependency`` of each guarded task of the app (a dependency
  given only per call is not known here), read with the store's ``budget_status`` under that task's policy.
* ordering keys that wait for a missing earlier message (when a guarded task declares ``ordering_key``): how
  many, the oldest wait's age, and the :data:`ORDERING_SHOWN` oldest (key, the number waited for, since when),
  from the store's index of waits (written as a wait starts and ends, not by each look of a waiting message).
* per watched schedule (every beat entry: its policy, or the default one): records of the run ledger in the last
  :data:`WINDOW` seconds that were missed or overdue (a period that was missed or overdue and then ran still
  counts: its ``missed_at`` / ``overdue_at`` stay), the newest successful period, and the newest record's
  status, read with the store's ``run_list``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery_guardrails.broker.queues import QueueDepth, read_queues
from celery_guardrails.foundation.redaction import DEFAULT, exception_text, for_app
from celery_guardrails.operations import activity
from celery_guardrails.operations.activity import QueueRate
from celery_guardrails.scheduling.ledger import MISSED, OK, OVERDUE
from celery_guardrails.stores import django_apps_installed

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Entries of the Redis dead-letter stream read at most per status read (the newest).
STREAM_SCAN = 10_000
#: Seconds of ledger records the missed and overdue counts look at (7 days, as the admin's schedule health).
WINDOW = 7 * 24 * 3600.0
#: Ledger records read per schedule at most (newest first) for the counts in the window.
LEDGER_SCAN = 2000

#: Whole minutes the rates in and out are averaged over.
RATE_MINUTES = 5

QUEUES, DEAD_LETTERS, DEPENDENCIES, SCHEDULES = "queues", "dead_letters", "dependencies", "schedules"
RATES, OUTBOX = "rates", "outbox"
ORDERING = "ordering"
WAITING = "waiting"
#: The sources, in the order they are read and shown.
SOURCES = (QUEUES, RATES, WAITING, DEAD_LETTERS, DEPENDENCIES, SCHEDULES, OUTBOX, ORDERING)
#: Waiting messages listed at most (the soonest due); the counts cover them all.
WAITING_SHOWN = 20
#: Waiting ordering keys listed at most (the oldest waits); the count covers them all.
ORDERING_SHOWN = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterCount:
    """Open dead letters of one (owner, task); ``owner`` "" when the task names none."""

    owner: str
    task: str
    open: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetters:
    counts: list[DeadLetterCount]
    #: The Redis stream holds more entries than were read (the counts are of the newest STREAM_SCAN).
    truncated: bool = False

    def by_owner(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for count in self.counts:
            totals[count.owner] += count.open
        return dict(sorted(totals.items()))


@dataclass(frozen=True, slots=True, kw_only=True)
class DependencyStatus:
    """Retry budget use and circuit state of one dependency (see :func:`celery_guardrails.budget_status`)."""

    dependency: str
    retries: float
    retries_allowed: float
    exhausted: bool
    circuit: str
    consecutive_failures: int
    window_seconds: float = 0.0  # the budget's window (retry_budget_window)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStatus:
    """One guarded schedule's ledger, over the last WINDOW seconds. Times are epoch seconds."""

    schedule: str
    missed: int
    overdue: int
    #: Period of the newest ``ok`` record; None when none is kept.
    last_success: float | None
    #: Seconds since ``last_success`` (None with it).
    last_success_age: float | None
    #: Status of the newest record; None when the schedule has none.
    last_status: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxBacklog:
    """The transactional outbox (Django): messages waiting for the relay, and the age of the oldest (seconds;
    None when none waits): the relay's lag."""

    waiting: int
    oldest_age: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderingWait:
    """An ordering key whose messages wait for sequence number ``waiting_for`` (the lowest waiting is
    ``lowest``), since ``since`` (epoch seconds), ``age`` seconds before the read."""

    key: str
    waiting_for: int
    lowest: int
    since: float
    age: float


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderingWaits:
    """Ordering keys waiting for a missing earlier message: how many, the oldest wait's age (seconds; None when
    none waits) and the oldest waits (at most ORDERING_SHOWN, oldest first)."""

    waiting: int
    oldest_age: float | None
    oldest: list[OrderingWait]


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingMessage:
    """A message waiting for its countdown (see :mod:`celery_guardrails.guardrails.waiting`); times are epoch seconds,
    ``reason_text`` and ``due_text`` as people read them ("budget payments-api", "in 4 min")."""

    task: str
    task_id: str
    tenant: str
    reason: str
    detail: str
    reason_text: str
    attempt: int
    due: float
    due_text: str
    since: float
    overdue: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """The messages waiting for a countdown: how many, per reason, and the WAITING_SHOWN soonest due."""

    count: int
    by_reason: dict[str, int]
    soonest: list[WaitingMessage]


@dataclass(slots=True, kw_only=True)
class Status:
    """Everything :func:`gather` read; a source that failed is empty and named in ``errors``."""

    at: float
    queues: list[QueueDepth] = field(default_factory=list)
    dead_letters: DeadLetters = field(default_factory=lambda: DeadLetters(counts=[]))
    dependencies: list[DependencyStatus] = field(default_factory=list)
    schedules: list[ScheduleStatus] = field(default_factory=list)
    #: Source name -> why it could not be read.
    errors: dict[str, str] = field(default_factory=dict)
    #: Watch mode: net change of each queue's depth per second since the previous read (arrivals minus
    #: departures; a broker does not tell the two apart without consuming).
    depth_change: dict[str, float] = field(default_factory=dict)
    #: Per queue, deliveries ended and messages arrived per minute over the last RATE_MINUTES whole minutes,
    #: from the activity the workers keep (None: not read, ``activity`` is off or the read failed).
    rates: dict[str, QueueRate] | None = None
    #: The outbox's backlog (None: not read, the Django app is not installed).
    outbox: OutboxBacklog | None = None
    #: Ordering keys that wait (None: not read, no guarded task of the app has an ``ordering_key``).
    ordering: OrderingWaits | None = None
    #: Messages re-published with a countdown, waiting for it (None: not read, the app has no guarded task).
    waiting: Waiting | None = None


def read_dead_letters(app: Any) -> DeadLetters:
    """Open dead letters per (owner, task), from every sink of the app (see the module docstring)."""
    from celery_guardrails.runtime.dead_letters import DjangoSink, RedisStreamSink, sinks_for

    totals: Counter[tuple[str, str]] = Counter()
    truncated = False
    for sink in sinks_for(app):
        if isinstance(sink, DjangoSink):
            totals.update(_django_dead_letters())
        elif isinstance(sink, RedisStreamSink):
            counts, cut = _stream_dead_letters(sink.client)
            totals.update(counts)
            truncated = truncated or cut
    found = [DeadLetterCount(owner=owner, task=task, open=n) for (owner, task), n in sorted(totals.items())]
    return DeadLetters(counts=found, truncated=truncated)


def _django_dead_letters() -> Counter[tuple[str, str]]:
    from django.db.models import Count

    from django_celery_guardrails.models import DeadLetter

    rows = DeadLetter.objects.open().order_by().values("owner", "task_name").annotate(n=Count("pk"))
    return Counter({(row["owner"] or "", row["task_name"]): row["n"] for row in rows})


def _stream_dead_letters(client: Any) -> tuple[Counter[tuple[str, str]], bool]:
    from celery_guardrails.runtime.dead_letters import STREAM

    counts: Counter[tuple[str, str]] = Counter()
    read, top = 0, "+"
    while read < STREAM_SCAN:
        page = client.xrevrange(STREAM, max=top, min="-", count=min(1000, STREAM_SCAN - read))
        if top != "+":
            page = page[1:]  # the first is the last entry of the previous page
        if not page:
            break
        for entry_id, fields in page:
            read += 1
            top = entry_id
            try:
                record = json.loads(fields[b"record"])
                counts[(str(record.get("owner") or ""), str(record.get("task_name") or ""))] += 1
            except (KeyError, TypeError, ValueError):
                logger.warning("Status: dead-letter stream entry %r is not a record; not counted", entry_id)
    truncated = read >= STREAM_SCAN and int(client.xlen(STREAM)) > read
    return counts, truncated


def read_dependencies(app: Any) -> list[DependencyStatus]:
    """Budget and circuit of each dependency a guarded task of the app declares."""
    from celery_guardrails.foundation.clock import now
    from celery_guardrails.guardrails.budget import policy_for
    from celery_guardrails.options import task_attribute
    from celery_guardrails.runtime.task import GuardedTask
    from celery_guardrails.stores import get_store

    tasks: dict[str, Any] = {}
    for task in app.tasks.values():
        dependency = task_attribute(task, "dependency") if isinstance(task, GuardedTask) else None
        if dependency and dependency not in tasks:
            tasks[dependency] = task
    store = get_store(app) if tasks else None
    found = []
    for dependency, task in sorted(tasks.items()):
        status = store.budget_status(dependency, policy_for(task, {}), now=now(app))  # type: ignore[union-attr]
        found.append(
            DependencyStatus(
                dependency=dependency,
                retries=float(status["retries"]),
                retries_allowed=float(status["retries_allowed"]),
                exhausted=bool(status["exhausted"]),
                circuit=str(status["circuit"]),
                consecutive_failures=int(status["consecutive_failures"]),
                window_seconds=float(status["window_seconds"]),
            )
        )
    return found


def read_schedules(app: Any) -> list[ScheduleStatus]:
    """The ledger of each watched schedule: every beat entry, with its policy or the default one (see the module
    docstring)."""
    from celery_guardrails.foundation.clock import now
    from celery_guardrails.options import app_value
    from celery_guardrails.scheduling.beat import all_configured_entries
    from celery_guardrails.stores import get_store

    policies = app_value(app, "schedules")
    names = {name for name, policy in policies.items() if policy is not None}
    try:
        entries, disabled = all_configured_entries(app)
        names |= {*entries, *disabled}
    except Exception:  # a bad setting (beat and the worker say it), rows out of reach: the policies' ledgers still
        logger.debug("Status: the beat entries cannot be read; the schedules with a policy are listed", exc_info=True)
    if not names:
        return []
    store = get_store(app)
    current = now(app)
    since = current - WINDOW
    found = []
    for name in sorted(names):
        runs = store.run_list(name, limit=LEDGER_SCAN)
        recent = [run for run in runs if run.period >= since]
        success = next((run for run in runs if run.status == OK), None)
        if success is None and len(runs) >= LEDGER_SCAN:  # older than what was read: ask for it alone
            success = next(iter(store.run_list(name, statuses=(OK,), limit=1)), None)
        found.append(
            ScheduleStatus(
                schedule=name,
                missed=sum(1 for run in recent if run.status == MISSED or run.missed_at is not None),
                overdue=sum(1 for run in recent if run.status == OVERDUE or run.overdue_at is not None),
                last_success=None if success is None else success.period,
                last_success_age=None if success is None else max(0.0, current - success.period),
                last_status=runs[0].status if runs else None,
            )
        )
    return found


def ordered(app: Any) -> bool:
    """Whether a guarded task of the app declares an ``ordering_key`` (one given only per call is not known)."""
    from celery_guardrails.options import task_attribute
    from celery_guardrails.runtime.task import GuardedTask

    return any(
        isinstance(task, GuardedTask) and task_attribute(task, "ordering_key") is not None
        for task in list(app.tasks.values())
    )


def read_ordering(app: Any, *, now: float) -> OrderingWaits:
    """The ordering keys that wait, from the store's index of waits (:meth:`Store.order_waits`)."""
    from celery_guardrails.stores import get_store

    found = get_store(app).order_waits(now=now, limit=ORDERING_SHOWN)
    oldest = [
        OrderingWait(
            key=wait.key,
            waiting_for=wait.waiting_for,
            lowest=wait.lowest,
            since=wait.since,
            age=max(0.0, now - wait.since),
        )
        for wait in found.oldest
    ]
    return OrderingWaits(waiting=found.count, oldest_age=oldest[0].age if oldest else None, oldest=oldest)


def attempt(source: str, read: Callable[[], T], errors: dict[str, str], *, app: Any = None) -> T | None:
    """``read()``, or None with the failure logged and kept in ``errors[source]`` (redacted with ``app``'s
    settings, else the defaults): a status read or a scrape goes on without a source it cannot read."""
    try:
        return read()
    except Exception as exc:
        # The reason in the warning, the traceback at debug: a status command prints no traceback for a down store.
        logger.warning("Guardrails status: reading %s failed: %r", source, exc)
        logger.debug("Guardrails status: reading %s failed", source, exc_info=True)
        # Printed by the commands: a store's error names its URL, password included.
        redaction = for_app(app) if app is not None else DEFAULT
        errors[source] = redaction.text(f"{type(exc).__name__}: {exception_text(exc)}", keep=300)
        return None


def gather(app: Any, *, queues: Iterable[str] = (), now: float | None = None) -> Status:
    """Read every source (see the module docstring); never raises for a source that cannot be read."""
    names = list(queues)
    status = Status(at=time.time() if now is None else now)
    errors = status.errors
    status.queues = attempt(QUEUES, lambda: read_queues(app, names, now=status.at), errors, app=app) or []
    if activity.enabled(app):
        status.rates = attempt(RATES, lambda: activity.rates(app, minutes=RATE_MINUTES), errors, app=app)
    status.dead_letters = attempt(DEAD_LETTERS, lambda: read_dead_letters(app), errors, app=app) or DeadLetters(
        counts=[]
    )
    status.dependencies = attempt(DEPENDENCIES, lambda: read_dependencies(app), errors, app=app) or []
    status.schedules = attempt(SCHEDULES, lambda: read_schedules(app), errors, app=app) or []
    if django_apps_installed():
        status.outbox = attempt(OUTBOX, read_outbox, errors, app=app)
    if ordered(app):
        status.ordering = attempt(ORDERING, lambda: read_ordering(app, now=status.at), errors, app=app)
    if guarded(app):
        status.waiting = attempt(WAITING, lambda: read_waiting(app, now=status.at), errors, app=app)
    return status


def guarded(app: Any) -> bool:
    """Whether the app has a guarded task (only those can wait for a countdown the guardrails set)."""
    from celery_guardrails.runtime.task import GuardedTask

    return any(isinstance(task, GuardedTask) for task in list(app.tasks.values()))


def read_waiting(app: Any, *, now: float, tenants: frozenset[str] | None = None, limit: int = WAITING_SHOWN) -> Waiting:
    """The messages waiting for a countdown, from the store (:meth:`Store.waiting`): the ``limit`` soonest due;
    ``tenants``: only theirs."""
    from celery_guardrails.guardrails import waiting
    from celery_guardrails.stores import get_store

    found = get_store(app).waiting(now=now, limit=limit, tenants=tenants)
    order = {reason: n for n, reason in enumerate(waiting.REASONS)}
    by_reason = dict(sorted(found.by_reason.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))
    soonest = [
        WaitingMessage(
            task=wait.task_name,
            task_id=wait.task_id,
            tenant=wait.tenant,
            reason=wait.reason,
            detail=wait.detail,
            reason_text=waiting.label(wait),
            attempt=wait.attempt,
            due=wait.due,
            due_text=waiting.due_in_words(wait, now),
            since=wait.since,
            overdue=waiting.overdue(wait, now),
        )
        for wait in found.soonest
    ]
    return Waiting(count=found.count, by_reason=by_reason, soonest=soonest)


def read_outbox() -> OutboxBacklog:
    """The outbox's backlog (see :func:`django_celery_guardrails.outbox.backlog`)."""
    from django_celery_guardrails.outbox import backlog

    waiting, oldest = backlog()
    return OutboxBacklog(waiting=waiting, oldest_age=oldest)


def with_change(current: Status, previous: Status | None) -> Status:
    """``current`` with each queue's depth change per second since ``previous`` (watch mode)."""
    if previous is None or current.at <= previous.at:
        return current
    before = {queue.queue: queue.depth for queue in previous.queues}
    elapsed = current.at - previous.at
    current.depth_change = {
        queue.queue: (queue.depth - before[queue.queue]) / elapsed for queue in current.queues if queue.queue in before
    }
    return current


def as_dict(status: Status) -> dict[str, Any]:
    """``status`` as JSON-ready data (what ``--json`` prints)."""
    data = dataclasses.asdict(status)
    data["dead_letters"]["by_owner"] = status.dead_letters.by_owner()
    return data


def as_json(status: Status) -> str:
    return json.dumps(as_dict(status), indent=2, sort_keys=True)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _rate(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def render(status: Status) -> str:
    """``status`` as text tables: queues, open dead letters by owner, dependencies, schedule health."""
    from celery_guardrails.guardrails.budget import budget_use

    lines: list[str] = []
    watch = bool(status.depth_change)
    rated = status.rates is not None or RATES in status.errors
    headers = ["QUEUE", "DEPTH", "OLDEST"] + (["IN/MIN", "OUT/MIN"] if rated else []) + (["CHANGE/S"] if watch else [])
    rows = []
    for queue in status.queues:
        row = [queue.queue, str(queue.depth), _age(queue.oldest_age) + ("" if queue.exists else " (no such queue)")]
        if rated:
            rate = (status.rates or {}).get(queue.queue)
            row += ["?", "?"] if rate is None else [_rate(rate.arrived), _rate(rate.completed)]
        if watch:
            change = status.depth_change.get(queue.queue)
            row.append("" if change is None else f"{change:+.1f}")
        rows.append(row)
    lines += _section("Queues", QUEUES, status, headers, rows)
    if status.waiting is not None or WAITING in status.errors:
        lines += _waiting_lines(status)
    if rated:
        lines.insert(
            len(lines) - 1,
            f"  (in and out: per minute over the last {RATE_MINUTES} whole minutes; in = out + the depth's change;"
            " ? = not known yet)",
        )
    if RATES in status.errors:
        lines.insert(len(lines) - 1, f"  rates could not be read: {status.errors[RATES]}")
    owners = status.dead_letters.by_owner()
    rows = [[owner or "(no owner)", str(n)] for owner, n in owners.items()]
    lines += _section("Open dead letters", DEAD_LETTERS, status, ["OWNER", "OPEN"], rows)
    if status.dead_letters.truncated:
        lines.append(f"  (counted over the newest {STREAM_SCAN} entries of the dead-letter stream)")
    rows = [
        [
            d.dependency,
            # whole retries, with the unit (the store's sliding window weighs counts: 1.825/3 read as a typo)
            budget_use({"retries": d.retries, "retries_allowed": d.retries_allowed, "window_seconds": d.window_seconds})
            + (" exhausted" if d.exhausted else ""),
            d.circuit,
        ]
        for d in status.dependencies
    ]
    lines += _section("Dependencies", DEPENDENCIES, status, ["DEPENDENCY", "RETRY BUDGET", "CIRCUIT"], rows)
    rows = [
        [
            s.schedule,
            s.last_status or "no record",
            _age(s.last_success_age) if s.last_success is not None else "never",
            str(s.missed),
            str(s.overdue),
        ]
        for s in status.schedules
    ]
    headers = ["SCHEDULE", "LAST RECORD", "LAST SUCCESS", f"MISSED {WINDOW / 86400:g}D", "OVERDUE"]
    lines += _section("Schedules", SCHEDULES, status, headers, rows)
    if status.outbox is not None or OUTBOX in status.errors:
        box = status.outbox
        rows = [] if box is None else [[str(box.waiting), _age(box.oldest_age) if box.waiting else "-"]]
        lines += _section("Outbox", OUTBOX, status, ["WAITING", "OLDEST"], rows)
    if status.ordering is not None or ORDERING in status.errors:
        waits = status.ordering
        rows = [[w.key, f"#{w.waiting_for}", f"#{w.lowest}", _age(w.age)] for w in (waits.oldest if waits else [])]
        headers = ["ORDERING KEY", "WAITS FOR", "LOWEST WAITING", "SINCE"]
        lines += _section("Ordering waits", ORDERING, status, headers, rows)
        if waits is not None and waits.waiting:
            lines.insert(
                len(lines) - 1,
                f"  {waits.waiting} key(s) waiting for a missing earlier message; the oldest for "
                f"{_age(waits.oldest_age)} (ordering_gap_timeout gives a missing one up)",
            )
    return "\n".join(lines).rstrip() + "\n"


def _waiting_lines(status: Status) -> list[str]:
    from celery_guardrails.guardrails.waiting import in_words

    found = status.waiting
    rows = [
        [
            w.task,
            w.task_id,
            w.tenant or "-",
            w.reason_text,
            str(w.attempt),
            w.due_text,
            in_words(status.at - w.since),
        ]
        for w in (found.soonest if found else [])
    ]
    headers = ["TASK", "TASK ID", "TENANT", "REASON", "ATTEMPT", "DUE", "WAITING FOR"]
    lines = _section("Waiting (re-published with a countdown, not in a queue yet)", WAITING, status, headers, rows)
    if found is not None and found.count:
        counts = ", ".join(f"{reason} {n}" for reason, n in found.by_reason.items())
        more = f"; the {len(found.soonest)} soonest due:" if found.count > len(found.soonest) else ":"
        lines.insert(1, f"  {found.count} waiting: {counts}{more}")
    return lines


def _section(title: str, source: str, status: Status, headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = [title]
    if source in status.errors:
        lines.append(f"  could not be read: {status.errors[source]}")
    elif not rows:
        lines.append("  (none)")
    else:
        lines += ["  " + line for line in _table(headers, rows)]
    return [*lines, ""]
