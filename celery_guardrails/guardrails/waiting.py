"""Waiting work made visible: messages the guardrails re-published with a countdown, until they run again.

A retry after an error, a deferral by a retry budget or an open circuit, a wait for a concurrency slot, an
ordering turn, a busy idempotency key, an overlapping scheduled run, a pending dead letter: each re-publishes the
running message with a countdown (:func:`celery_guardrails.runtime.outcomes.republish`), and until the broker delivers
it again it is in no queue a status read can count (Redis keeps it in its ``unacked`` hash, RabbitMQ in a
delay queue). So each such re-publish also keeps one row per task id in the store (:meth:`Store.wait_note`):
task, tenant, reason, what it waits on, the attempt it will make, when it is due and since when it waits. The
admin's "Waiting" page and ``celery -A proj guardrails status`` list them, with counts per reason.

* **Written** by the re-publish, before the new message is published: a delivery that starts at once finds the
  row there to remove (written after, it could come after that removal and stay). The write never endangers the
  retry: whatever it raises is logged as one warning and the re-publish goes on (a row is a view, the message
  is the work). Only the countdown path writes; a delivery that is not re-published pays nothing. A message
  re-published because the store is out of reach writes nothing: the row would go to that same store, and
  each delivery of the outage would wait for its timeout twice.
* **One row per task id**: each re-publish of a message replaces its row (a key waiting through many quick
  re-publishes stays one row). ``since`` is read from the message's history (the first of the consecutive
  records of the same wait), so it survives the replacements.
* **Removed as the next delivery starts** (the :class:`Waiting` guardrail's ``before_run``, the first that reads
  the store): from then on the message is running, not waiting, and a long run must not show as an overdue
  wait. Only a delivery whose message says it was re-published with a countdown asks (its last history record
  has a ``delay``, or it carries a pending dead letter): a first delivery costs nothing.
* **Forgotten** :data:`KEPT_AFTER_DUE` seconds after it was due, without a delivery (its message was lost, a
  worker without this guardrail ran it): a row cannot stay for ever. Past :data:`OVERDUE_AFTER` seconds after
  its due time it is shown "overdue" (a queue backed up behind it, no worker consuming, or lost).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import view
from celery_guardrails.runtime.pipeline import Guardrail, overriding
from celery_guardrails.stores.base import Wait

logger = logging.getLogger(__name__)

#: Seconds after its due time a wait is shown "overdue".
OVERDUE_AFTER = 300.0
#: Seconds after its due time a wait no delivery removed is forgotten (its message presumably lost).
KEPT_AFTER_DUE = 24 * 3600.0

RETRY, LATER, BUDGET, CIRCUIT = "retry", "later", "budget", "circuit"
CONCURRENCY, ORDERING, BUSY, OVERLAP = "concurrency", "ordering", "busy", "overlap"
DEAD_LETTER = "dead_letter"
#: Every reason a wait can have, in the order counts are shown.
REASONS = (RETRY, LATER, BUDGET, CIRCUIT, CONCURRENCY, ORDERING, BUSY, OVERLAP, DEAD_LETTER)
#: How each reason reads, before its detail.
LABELS = {
    RETRY: "retry after",
    LATER: "retry later:",
    BUDGET: "budget",
    CIRCUIT: "circuit",
    CONCURRENCY: "concurrency",
    ORDERING: "ordering",
    BUSY: "busy key",
    OVERLAP: "overlap",
    DEAD_LETTER: "dead letter not yet recorded:",
}

#: Reasons of a "retry_later" attempt record, by its rule, and the key its RetryLater message names.
_LATER_RULES: dict[str, tuple[str, re.Pattern[str] | None]] = {
    "concurrency:full": (CONCURRENCY, re.compile(r"concurrency key (.+): all \d+ slot")),
    "concurrency:slot_lost": (CONCURRENCY, None),
    "ordering:wait": (ORDERING, re.compile(r"ordering key (.+): sequence \d+ waits")),
    "idempotency:busy": (BUSY, re.compile(r"idempotency key (.+) is held by")),
    "schedule:overlap": (OVERLAP, None),
}
#: Record classes of waits that do not run the body (consecutive ones are one wait: ``since`` is the first).
_WAITS_ONLY = frozenset({"retry_later", "deferred_budget", "deferred_circuit"})
#: Longest detail kept (a key, an error class).
DETAIL_LIMIT = 255


class Waiting(Guardrail):
    """Removes the waiting row of a message re-published with a countdown as its next delivery starts."""

    def before_run(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        if not came_back(view(task).header):
            return
        try:
            from celery_guardrails.stores import get_store

            get_store(task.app).wait_done(request.id)
        except Exception as exc:  # a view of the work, never a reason to refuse it: the row expires on its own
            logger.warning("Task %s[%s]: its waiting row was not removed (%r)", task.name, request.id, exc)


def came_back(header: Mapping[str, Any]) -> bool:
    """Whether the message was re-published with a countdown (so a waiting row may be kept for it)."""
    return headers.PENDING_DEAD_LETTER in header or bool(_last(header).get("delay"))


def _last(header: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message's last attempt record ({} when it has none)."""
    history = header.get(headers.HISTORY)
    last = history[-1] if isinstance(history, list) and history else None
    return last if isinstance(last, Mapping) else {}


def enabled(task: Any) -> bool:
    """Whether re-publishes of ``task`` keep a waiting row: only when the task runs the guardrail that removes it
    (a task whose ``guardrails`` leave it out would leave its rows until they expire)."""
    removers = overriding(getattr(task, "guardrails", ()), "before_run")
    return any(isinstance(g, Waiting) for g in removers)


def note(task: Any, *, header: Mapping[str, Any], countdown: float) -> None:
    """Keep the waiting row of ``task``'s message, re-published with ``header`` after ``countdown`` seconds.
    Never raises: a failure is one warning (the re-publish goes on)."""
    try:
        if countdown <= 0:
            return  # delivered again at once: in its queue, where the status counts it
        if _last(header).get("class") == "store_unavailable" or not enabled(task):
            return  # the store is out of reach (see the module docstring), or nothing would remove the row
        from celery_guardrails.stores import get_store

        get_store(task.app).wait_note(describe(task, header=header, countdown=countdown, now=time.time()))
    except Exception as exc:
        request = getattr(task, "request", None)
        logger.warning(
            "Task %s[%s]: its wait is not shown (%r); re-published all the same",
            getattr(task, "name", "?"),
            getattr(request, "id", "?"),
            exc,
        )


def describe(task: Any, *, header: Mapping[str, Any], countdown: float, now: float) -> Wait:
    """The waiting row of ``task``'s message re-published with ``header`` after ``countdown`` seconds."""
    request = task.request
    history = [record for record in header.get(headers.HISTORY) or () if isinstance(record, Mapping)]
    last = history[-1] if history else {}
    reason, detail = _reason(task, header, last)
    due = now + countdown
    return Wait(
        task_id=str(request.id),
        task_name=str(task.name),
        tenant=str(header.get(headers.TENANT) or ""),
        queue=str((request.delivery_info or {}).get("routing_key") or ""),
        reason=reason,
        detail=detail[:DETAIL_LIMIT],
        attempt=headers.counter(header, headers.ATTEMPT) + 1,
        due=due,
        since=min(_since(history, now), now),
        expires=due + KEPT_AFTER_DUE,
    )


def _reason(task: Any, header: Mapping[str, Any], last: Mapping[str, Any]) -> tuple[str, str]:
    if headers.PENDING_DEAD_LETTER in header:
        pending = header[headers.PENDING_DEAD_LETTER]
        return DEAD_LETTER, str(pending.get("reason") or "") if isinstance(pending, Mapping) else ""
    kind, rule, text = str(last.get("class") or ""), str(last.get("rule") or ""), str(last.get("msg") or "")
    if kind in ("deferred_budget", "deferred_circuit"):
        dependency = view(task).options["dependency"]
        return (BUDGET if kind == "deferred_budget" else CIRCUIT), str(dependency or "")
    if kind == "retry_later":
        reason, pattern = _LATER_RULES.get(rule, (LATER, None))
        found = pattern.search(text) if pattern is not None else None
        return reason, found.group(1) if found else text
    return RETRY, _short_name(last.get("exc"))


def _short_name(name: Any) -> str:
    """``HTTPError`` of ``requests.exceptions.HTTPError``: the class, as a list shows it."""
    return str(name or "").rpartition(".")[2]


def _since(history: list[Mapping[str, Any]], now: float) -> float:
    """When the current wait began: the end of the last record, or of the first of the consecutive records of
    the same wait that does not run the body (a key deferred twenty times has waited since the first)."""
    if not history:
        return now
    last = history[-1]
    first = last
    if last.get("class") in _WAITS_ONLY:
        for record in reversed(history[:-1]):
            if (record.get("class"), record.get("rule")) != (last.get("class"), last.get("rule")):
                break
            first = record
    return _seconds(first.get("end")) or now


def _seconds(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except (TypeError, ValueError):
        return None


# How a wait reads (the status command and the admin page).


def label(wait: Wait) -> str:
    """``retry after HTTPError``, ``budget payments-api``, ``concurrency pdf:acme``, ..."""
    words = LABELS.get(wait.reason, wait.reason)
    return f"{words} {wait.detail}".strip() if wait.detail else words.rstrip(":")


def overdue(wait: Wait, now: float) -> bool:
    return now - wait.due > OVERDUE_AFTER


def in_words(seconds: float) -> str:
    """A span as people say it: ``12 s``, ``4 min``, ``3 h``, ``2 d`` (rounded, never negative)."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size or (unit == "min" and seconds >= 60):
            return f"{round(seconds / size)} {unit}"
    return f"{round(seconds)} s"


def due_in_words(wait: Wait, now: float) -> str:
    """``in 4 min``, ``now`` (due within the last OVERDUE_AFTER seconds: being delivered), ``overdue 7 min``."""
    if wait.due > now:
        return f"in {in_words(wait.due - now)}"
    if overdue(wait, now):
        return f"overdue {in_words(now - wait.due)}"
    return "now"


def iso(seconds: float) -> str:
    """ISO 8601 in the local zone, to the second (what a title shows on hover)."""
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")
