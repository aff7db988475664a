"""Records that are not there yet: wait for a row another path writes, for at most ``record_wait``.

A task published inside a transaction (a plain ``delay`` in ``transaction.atomic``) can start before the
transaction commits, and a replica can lag its primary: the row the task reads is not there *yet*, and failing
for good would drop work whose record appears a moment later.

* ``require(queryset, **lookup)`` (``self.require(...)`` in a bound body) returns the one row
  ``queryset.get(**lookup)`` finds, or raises :class:`~celery_guardrails.exceptions.RecordNotThereYet` (a
  ``RetryLater``) naming the model (``app_label.Model``) and the lookup. Calling it is the author's word that the
  body has not acted yet (as raising ``RetryLater`` is): the retry gate is not asked.
* ``ObjectDoesNotExist`` (any model's ``DoesNotExist``) raised by the body is handled the same way when
  ``absent_records="wait"`` (the default), through the retry gate: a body that may already have acted (it marks
  no effect, or failed after one) is not run again, it ends as ``not_idempotent``. With ``"fail"`` it is
  permanent (classification rule 4, :mod:`celery_guardrails.runtime.classification`).
* Each wait re-publishes the message without spending an attempt (Retries' ``retry_later``, counted in the header
  as ``rec_wait``, not bounded by ``retry_later_max``): after 1 s, then 2 s, 4 s, ... (:func:`delays`), the last
  one cut so that the final look happens as ``record_wait`` runs out. The wait is counted from the first delivery
  that found the record missing (``rec_since`` in the header), across re-publishes. Then the final failure
  ``record_missing``, with the message naming the model and the lookup (redacted where it is kept).

Django is imported inside functions only: the core runs without it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_guardrails.exceptions import RecordNotThereYet
from celery_guardrails.options import APP, CALL, TASK, Option, checks, declare
from celery_guardrails.runtime import headers

#: The rule of a wait for a row ``require()`` did not find, and of one the body's ObjectDoesNotExist started.
REQUIRE_RULE = "records:require"
ABSENT_RULE = "absent_records:wait"
RULES = frozenset({REQUIRE_RULE, ABSENT_RULE})
#: Seconds of the first wait; each next one doubles (1, 2, 4, 8, ...), the last cut to what record_wait leaves.
FIRST_DELAY = 1.0
#: Doublings at most (a counter from a malformed or hostile header cannot overflow the delay).
MAX_DOUBLINGS = 40
#: Characters of one lookup value kept in the message (the whole message is redacted where it is kept).
VALUE_LIMIT = 100

DECLARED = declare(
    Option(
        name="record_wait",
        default=60.0,
        doc="Seconds a message waits, at most, for a record that is not there yet (require(), or the body's "
        "ObjectDoesNotExist with absent_records='wait'), counted from the first delivery that missed it; the "
        "waits double from 1 s and spend no attempt. Then a final failure record_missing.",
        check=checks.seconds,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="absent_records",
        default="wait",
        doc="What an ObjectDoesNotExist raised by the body means: 'wait' (the default): a record not committed "
        "yet, waited for as require() does, for at most record_wait, where the retry gate finds a re-run safe; "
        "'fail': permanent at once.",
        check=checks.choice("wait", "fail"),
        scopes=frozenset({TASK, APP}),
    ),
)


def require(queryset: Any, /, **lookup: Any) -> Any:
    """The one row of ``queryset`` (a QuerySet, a Manager or a model class) matching ``lookup``, or
    :class:`RecordNotThereYet` naming the model and the lookup (the message then waits for it: see the module).

    ``MultipleObjectsReturned`` is not a record that is missing: it is raised as it is.
    """
    from django.core.exceptions import ObjectDoesNotExist

    rows = queryset._default_manager.all() if hasattr(queryset, "_default_manager") else queryset
    try:
        return rows.get(**lookup)
    except ObjectDoesNotExist:
        raise RecordNotThereYet(rows.model._meta.label, describe(lookup)) from None


def describe(lookup: Mapping[str, Any]) -> str:
    """``pk=42, status='paid'``: the lookup as the message names it (each value cut to VALUE_LIMIT)."""
    return ", ".join(f"{name}={_shown(value)}" for name, value in lookup.items())


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= VALUE_LIMIT else text[: VALUE_LIMIT - 3] + "..."


def absent(exc: BaseException) -> bool:
    """Whether ``exc`` is Django's ``ObjectDoesNotExist`` (never importing Django: a process that has not imported
    it cannot have raised it)."""
    module = sys.modules.get("django.core.exceptions")
    klass = getattr(module, "ObjectDoesNotExist", None) if module is not None else None
    return isinstance(klass, type) and isinstance(exc, klass)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordWait:
    """The next wait of a message whose record is not there yet."""

    #: Seconds until it is delivered again.
    delay: float
    #: When its wait began (epoch seconds): carried in the header, so ``record_wait`` bounds the whole wait.
    since: float


def delays(record_wait: float) -> list[float]:
    """The waits of a record that never appears, when each look takes no time (:func:`next_wait`, re-published
    as Retries does): 1, 2, 4, ... seconds, the last cut so that they add up to ``record_wait``."""
    found: list[float] = []
    header: dict[str, Any] = {}
    start = now = 1.0  # any moment: the waits depend on the time since the first miss only
    while (wait := next_wait(header, record_wait=record_wait, started=start, now=now)) is not None:
        found.append(wait.delay)
        now += wait.delay
        header = {headers.RECORD_SINCE: wait.since, headers.RECORD_WAITS: len(found)}
    return found


def next_wait(header: Mapping[str, Any], *, record_wait: float, started: float, now: float) -> RecordWait | None:
    """The next wait of a message with ``header`` whose delivery, ``started`` then, missed its record, at
    ``now``; or None once ``record_wait`` is spent (a final failure ``record_missing``). A message that has not
    waited yet begins its wait at ``started``; a ``rec_since`` in the future (another host's clock) counts as
    now."""
    since = headers.record_since(header)
    since = min(started, now) if since is None else min(since, now)
    left = record_wait - (now - since)
    if left <= 0:
        return None
    waits = min(headers.counter(header, headers.RECORD_WAITS), MAX_DOUBLINGS)
    return RecordWait(delay=min(FIRST_DELAY * 2**waits, left), since=since)


__all__ = [
    "ABSENT_RULE",
    "DECLARED",
    "REQUIRE_RULE",
    "RULES",
    "RecordWait",
    "absent",
    "delays",
    "describe",
    "next_wait",
    "require",
]
