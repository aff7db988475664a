"""A status read as people and programs read it: :func:`render` writes text tables (queues with their rates and
depth change, the waiting messages, open dead letters by owner, dependencies, schedules, the outbox, ordering
waits; a source that could not be read says why in its section), :func:`as_dict` and :func:`as_json` the data
that ``--json`` prints.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from celery_guardrails.operations.status_data import (
    DEAD_LETTERS,
    DEPENDENCIES,
    ORDERING,
    OUTBOX,
    QUEUES,
    RATE_MINUTES,
    RATES,
    SCHEDULES,
    STREAM_SCAN,
    WAITING,
    WINDOW,
    Status,
)


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
