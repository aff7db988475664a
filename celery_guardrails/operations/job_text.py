"""What ``celery -A proj guardrails job <id>`` prints: one job as text (its fields, then its history as a table)
or as JSON (every field of :class:`celery_guardrails.guardrails.jobs.JobView`).

Moments are written as every page of the admin writes them (``2026-12-03 14:05:09 UTC``; here always in UTC:
a command has no user's time zone), and control or invisible characters of a stored value as their escapes
(``\\u202e``), so that a value from a message cannot forge or reverse a line of the output.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

#: A moment, as the admin writes it (django_celery_guardrails.display.MOMENT_FORMAT), in UTC.
MOMENT_FORMAT = "%Y-%m-%d %H:%M:%S %Z"
EMPTY = "-"


def shown(value: object) -> str:
    """``value`` as text with control and invisible characters written as escapes."""
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def moment(value: str | None) -> str:
    """An ISO-8601 moment as :data:`MOMENT_FORMAT` in UTC; :data:`EMPTY` for none, unreadable text as it is."""
    if not value:
        return EMPTY
    try:
        found = datetime.fromisoformat(value)
    except ValueError:
        return shown(value)
    if found.tzinfo is None:
        found = found.replace(tzinfo=UTC)
    return found.astimezone(UTC).strftime(MOMENT_FORMAT)


def as_json(view: Any) -> str:
    """The job as JSON (every field; moments as ISO-8601 text, the history as a list)."""
    data = dataclasses.asdict(view)
    data["history"] = list(data["history"])
    data["terminal"] = view.terminal
    return json.dumps(data, indent=2, default=str)


def render(view: Any) -> str:
    """The job as lines of text: its fields, then its history oldest first."""
    if view.progress_done is None:
        progress = EMPTY
    else:
        total = "?" if view.progress_total is None else str(view.progress_total)
        progress = f"{view.progress_done}/{total}"
    state = f"{view.state} (attempt {view.attempt})" + (f": {shown(view.detail)}" if view.detail else "")
    fields = [
        ("job", view.id),
        ("task", f"{shown(view.task_name)}[{shown(view.task_id)}]"),
        ("tenant", shown(view.tenant) or EMPTY),
        ("state", state + (" — final" if view.terminal else "")),
        ("progress", progress),
        ("submitted", moment(view.created_at)),
        ("started", moment(view.started_at)),
        ("finished", moment(view.finished_at)),
        ("due", moment(view.due_at)),
        ("cancel asked", moment(view.cancel_requested_at)),
        ("error", shown(view.error) or EMPTY),
        ("dead letter", shown(view.dead_letter_task_id) or EMPTY),
        ("output", shown(view.output_ref) or EMPTY),
    ]
    width = max(len(name) for name, _ in fields)
    lines = [f"{name:<{width}}  {value}" for name, value in fields]
    rows = [
        [
            moment(str(entry.get("at") or "")),
            shown(entry.get("state", "")),
            str(entry.get("attempt", "")),
            shown(entry.get("detail", "")),
        ]
        for entry in view.history
    ]
    headers = ["at", "state", "attempt", "detail"]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines += ["", "history:"]
    lines += [
        "  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in [headers, *rows]
    ]
    return "\n".join(lines)
