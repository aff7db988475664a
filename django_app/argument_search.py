"""Search dead letters by argument: ``order_id=42`` finds "the one for order 42" among 40,000.

A search term ``path=value``: the path names a keyword argument (``order_id``), a positional one by its parameter's
name (``order_id`` of ``charge(order_id, amount)``, for the tasks this process knows) or by its position (``#0``),
and goes on into nested mappings with dots (``customer.id=7``, ``#1.id=7``). The value is compared as JSON: ``42``
matches the number 42 and the text "42", ``true`` / ``null`` the JSON values and their text, ``"42"`` (quoted) the
text only; anything else is text.

Only what a record stores can match, and it stores its arguments redacted: a secret's value never matches (the
record holds ``[redacted]`` in its place), and neither does a search for the placeholder itself
(:class:`Unsearchable`). Arguments stored as text (``arguments_are_repr``) are not searched.

On PostgreSQL, JSON containment (``kwargs @> '{"order_id": 42}'``) served by GIN indexes on ``args`` and
``kwargs`` (``jsonb_path_ops``, migration ``0026``), whatever the number of records. Elsewhere, a scan bounded to
the newest :data:`SCAN_LIMIT` records (:attr:`Search.bounded` says when it stopped there).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Any

from django.db import connection
from django.db.models import Q, QuerySet

from celery_guardrails.foundation.redaction import REDACTED
from celery_guardrails.guardrails.keys import task_signature

from . import health
from .discovery import import_task_modules
from .models import DeadLetter

#: Records a search looks at without an index (the newest, by id).
SCAN_LIMIT = 100_000
#: Characters of a search term read as a path and a value at most.
TERM_LIMIT = 500
_TERM = re.compile(
    r"(?P<path>(?:#\d{1,3}|[A-Za-z_]\w{0,99})(?:\.[A-Za-z_]\w{0,99}|\.\d{1,3}){0,8})=(?P<value>.+)", re.S
)


class Unsearchable(ValueError):
    """A term that looks like an argument search but can match nothing (a redacted value); the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ArgumentTerm:
    """A parsed ``path=value``."""

    #: The first step: a parameter's name, or a position (int).
    head: str | int
    #: The steps into nested mappings and lists after it.
    rest: tuple[str | int, ...]
    #: The JSON values the stored one may be.
    values: tuple[Any, ...]
    #: As typed, for the list's "matched" line.
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Search:
    #: What the records found match (a condition, so that a caller can also mark the rows it found).
    condition: Q
    #: Whether only the newest SCAN_LIMIT records were looked at (no index on this database).
    bounded: bool

    def of(self, records: QuerySet[DeadLetter]) -> QuerySet[DeadLetter]:
        return records.filter(self.condition)


def _step(part: str) -> str | int:
    return int(part) if part.isdigit() else part


def parse(term: str) -> ArgumentTerm | None:
    """The argument search ``term`` asks for, or None when it is not one (an id search); :class:`Unsearchable`
    for a search of a redacted value."""
    found = _TERM.fullmatch(term.strip()[:TERM_LIMIT])
    if found is None:
        return None
    first, *rest = found["path"].split(".")
    head: str | int = int(first[1:]) if first.startswith("#") else first
    raw = found["value"].strip()
    if REDACTED in raw:
        raise Unsearchable(f"{REDACTED} stands for a value the record does not keep: it matches nothing")
    return ArgumentTerm(head=head, rest=tuple(_step(p) for p in rest), values=_values(raw), text=term.strip())


def _values(raw: str) -> tuple[Any, ...]:
    """The JSON values ``raw`` may stand for: a number or a literal and its text; a quoted text itself only."""
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        try:
            quoted = json.loads(raw)
        except ValueError:
            return (raw,)
        return (quoted,) if isinstance(quoted, str) else (raw,)
    try:
        value = json.loads(raw)
    except ValueError:
        return (raw,)
    if isinstance(value, bool | int | float) or value is None:
        return (value, raw)
    return (raw,)  # an object or a list typed in: matched as text (containment of a whole structure is not asked)


def _nested(steps: tuple[str | int, ...], value: Any) -> Any:
    """``value`` under ``steps`` as JSON containment reads it (a position is a one-item list: any position)."""
    for step in reversed(steps):
        value = [value] if isinstance(step, int) else {step: value}
    return value


def positional_parameters(task: Any) -> list[str]:
    """The positional parameters of ``task`` (none when its signature cannot be read): what names its stored
    ``args``, in the list's argument summary (``order_id=42``) and in a search."""
    try:
        parameters = task_signature(task).parameters.values()  # read once per task class
    except Exception:  # no signature to read: by position (a page must show)
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _positions(name: str) -> dict[str, int]:
    """The tasks this process knows whose parameter ``name`` is positional, with its position."""
    app = health.celery_app()
    import_task_modules(app)
    found = {}
    for task_name, task in list(app.tasks.items()):
        positional = positional_parameters(task)
        if name in positional:
            found[task_name] = positional.index(name)
    return found


def _exact(column: str, steps: tuple[str | int, ...], value: Any) -> Q:
    """The stored value at ``steps`` of ``column`` is ``value`` (a key transform: exact, at its position). The
    lookup is named: an argument called ``contains`` or ``in`` is a key then, not Django's lookup of that name."""
    return Q(**{"__".join([column, *map(str, steps), "exact"]): value})


def _matches(term: ArgumentTerm, indexed: bool) -> Q:
    # Positions the head may be at, each with the tasks that take it there (None: any task, asked by position).
    positions: dict[int, list[str] | None] = {}
    if isinstance(term.head, int):
        positions[term.head] = None
    else:
        for task_name, index in _positions(term.head).items():
            positions.setdefault(index, []).append(task_name)  # type: ignore[union-attr]
    conditions = []
    for value in term.values:
        if isinstance(term.head, str):
            steps = (term.head, *term.rest)
            # Containment: what the GIN index answers (PostgreSQL); a key transform elsewhere.
            conditions.append(Q(kwargs__contains=_nested(steps, value)) if indexed else _exact("kwargs", steps, value))
        placed = [
            (Q() if tasks is None else Q(task_name__in=tasks)) & _exact("args", (index, *term.rest), value)
            for index, tasks in positions.items()
        ]
        if placed:
            exact = reduce(or_, placed)
            # The index finds the records holding the value at any position; the key transforms keep those holding
            # it where their task takes it.
            conditions.append(Q(args__contains=[_nested(term.rest, value)]) & exact if indexed else exact)
    return reduce(or_, conditions, Q(pk__in=[]))


def search(term: ArgumentTerm) -> Search:
    """What a record whose stored arguments hold ``term`` matches."""
    indexed = connection.vendor == "postgresql"
    condition = _matches(term, indexed) & Q(arguments_are_repr=False)
    if indexed:
        return Search(condition=condition, bounded=False)
    newest = DeadLetter.objects.order_by("-pk").values_list("pk", flat=True)[SCAN_LIMIT : SCAN_LIMIT + 1]
    floor = next(iter(newest), None)
    if floor is None:
        return Search(condition=condition, bounded=False)
    return Search(condition=condition & Q(pk__gt=floor), bounded=True)


__all__ = ["SCAN_LIMIT", "ArgumentTerm", "Search", "Unsearchable", "parse", "positional_parameters", "search"]
