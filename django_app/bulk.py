"""Act on every open dead letter a filter matches, in the background: replay, discard or resolve "all N matching"
after an outage, as a job (``task.submit()``'s records: its progress, its state, its cancel) of the guardrails'
task ``django_celery_guardrails.bulk_dead_letters``.

:class:`Matching` is the filter, as a message can carry it: the change list's filters (reason, task, owner,
tenant, cause, a window of last failures), its search term (ids, or an argument: :mod:`.argument_search`), and the
last record id when it was asked, so that records recorded later are left alone. :func:`start` checks the
permission and submits the job; :func:`run` (the task's body, and what tests call) reads the open records the filter
matches for that user (:mod:`.scoping`), :data:`BATCH` at a time in id order (read :data:`READ_AHEAD` batches at a
time), and for each batch: replays them with
:func:`.replay.replay_dead_letters` (the permission, the ``not_idempotent`` rule, every refusal: the replay's own
checks) or closes them (:func:`.maintenance.close_dead_letters`), writes one LogEntry naming the action, the filter
and the counts, reports its progress, and stops before the next batch when the job's cancel was asked. Every step
is conditional (a record moves from open once), so a job run again after a crash acts on what is still open.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.db.models import Max, Q, QuerySet
from django.utils import timezone

from . import argument_search, health
from .discovery import import_task_modules
from .maintenance import close_dead_letters
from .models import DeadLetter
from .replay import replay_dead_letters
from .scoping import scope

logger = logging.getLogger(__name__)

#: The task that runs a bulk action (``django_celery_guardrails.tasks``).
TASK = "django_celery_guardrails.bulk_dead_letters"
#: Records acted on per batch: one LogEntry, one progress report and one look at the job's cancel each.
BATCH = 500
#: Batches of ids read ahead by one query: each read sorts the matching records by id (over 1,000,000 records, a
#: read for every batch of a 40,000-record cause made its replay 1.5x plain Celery's publishing).
READ_AHEAD = 100
#: The actions, with the permission each needs and the status a closing one leaves.
ACTIONS = {
    "replay": ("guardrails.replay_deadletter", ""),
    "discard": ("guardrails.discard_deadletter", DeadLetter.Status.DISCARDED),
    "resolve": ("guardrails.resolve_deadletter", DeadLetter.Status.RESOLVED),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Matching:
    """Which open records a bulk action takes (empty fields: any)."""

    #: The newest record id when the action was asked: later records are not taken.
    up_to: int
    #: Equal to this (None: any; "" is a value, as the change list's "-" choice of an empty owner or tenant).
    reason: str | None = None
    task_name: str | None = None
    owner: str | None = None
    tenant: str | None = None
    fingerprint: str | None = None
    #: The change list's search term: an exact id, or an argument (``order_id=42``).
    search: str | None = None
    #: ISO 8601: last failures at or after / before these moments.
    failed_since: str | None = None
    failed_before: str | None = None

    @classmethod
    def now(cls, **filters: str | None) -> Matching:
        """The filter ``filters``, up to the newest record recorded now."""
        newest = DeadLetter.objects.aggregate(newest=Max("pk"))["newest"] or 0
        return cls(up_to=int(newest), **filters)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Matching:
        known = {spec.name for spec in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown filter field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if value is not None}

    def described(self) -> str:
        """The filter in a line, for the LogEntries: ``reason=circuit_open, fingerprint=..., up to #41000``."""
        parts = [f"{name}={value}" for name, value in self.to_dict().items() if name != "up_to"]
        return ", ".join([*parts, f"up to #{self.up_to}"])

    def records(self, user: Any = None) -> QuerySet[DeadLetter]:
        """The open records this filter matches that ``user`` may see (every one for None)."""
        found = DeadLetter.objects.open().filter(pk__lte=self.up_to)
        exact = {
            name: getattr(self, name)
            for name in ("reason", "task_name", "owner", "tenant", "fingerprint")
            if getattr(self, name) is not None
        }
        found = found.filter(**exact)
        if self.failed_since:
            found = found.filter(last_failed_at__gte=_moment(self.failed_since))
        if self.failed_before:
            found = found.filter(last_failed_at__lt=_moment(self.failed_before))
        if self.search:
            by_id = Q(task_id=self.search) | Q(correlation_id=self.search) | Q(idempotency_key=self.search)
            try:
                term = argument_search.parse(self.search)
            except argument_search.Unsearchable:  # a redacted value: no record holds it, by id or argument
                term = None
            found = found.filter(by_id | argument_search.search(term).condition if term else by_id)
        return scope(found, user)


def _moment(text: str) -> datetime:
    """An ISO 8601 moment (the date filter's ``2026-12-07 00:00:00+00:00``); one without a zone is in the current
    time zone, as the change list reads it."""
    moment = datetime.fromisoformat(text)
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


@dataclass(slots=True, kw_only=True)
class BulkResult:
    """What a bulk action did: records acted on, refused (counted by why), and whether it stopped early."""

    action: str
    done: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    stopped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "refused": dict(self.refused)}


def _check(action: str, user: Any) -> None:
    if action not in ACTIONS:
        raise ValueError(f"unknown bulk action {action!r}: one of {', '.join(ACTIONS)}")
    if user is not None and not user.has_perm(ACTIONS[action][0]):
        raise PermissionDenied(f"{getattr(user, 'username', user)} may not {action} dead letters")


def start(action: str, matching: Matching, *, user: Any, allow_not_idempotent: bool = False) -> Any:
    """Submit the bulk action as a job (its permission checked now, and again as it runs); the job."""
    _check(action, user)
    app = health.celery_app()
    import_task_modules(app)  # a web process: the guardrails' tasks as a worker finds them
    return app.tasks[TASK].submit(
        action,
        matching.to_dict(),
        user_id=getattr(user, "pk", None),
        allow_not_idempotent=allow_not_idempotent,
    )


def run(
    action: str,
    matching: Matching,
    *,
    user: Any = None,
    allow_not_idempotent: bool = False,
    batch: int = BATCH,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> BulkResult:
    """Act on the records ``matching`` takes, batch by batch (see the module docstring)."""
    _check(action, user)
    records = matching.records(user)
    total = records.count()
    result = BulkResult(action=action)
    after = 0
    ahead: list[int] = []
    while True:
        if stop is not None and result.batches and stop():
            result.stopped = True
            logger.info(
                "Bulk %s matching %s stopped after %s batch(es): its cancel was asked",
                action,
                matching.described(),
                result.batches,
            )
            break
        if not ahead:
            ahead = list(records.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[: batch * READ_AHEAD])
            if not ahead:
                break
        # (a record read ahead that another hand closed since is the replay's refusal, or not closed again)
        ids, ahead = ahead[:batch], ahead[batch:]
        done, refused = _act(action, ids, user=user, allow_not_idempotent=allow_not_idempotent)
        result.done += done
        result.refused.update(refused)
        result.batches += 1
        _log(action, matching, ids, done, refused, user)
        if progress is not None:
            progress(result.done + sum(result.refused.values()), total)
        after = ids[-1]
    return result


def _act(action: str, ids: list[int], *, user: Any, allow_not_idempotent: bool) -> tuple[int, Counter[str]]:
    if action == "replay":
        replayed = replay_dead_letters(ids, user=user, allow_not_idempotent=allow_not_idempotent)
        return len(replayed.replayed), Counter(why for _, why in replayed.skipped)
    status = ACTIONS[action][1]
    changed = close_dead_letters(DeadLetter.objects.filter(pk__in=ids), status, user=user, by="bulk")
    # A record another hand closed meanwhile is not this action's
    return changed, Counter({"no longer open": len(ids) - changed} if changed < len(ids) else {})


def _log(action: str, matching: Matching, ids: list[int], done: int, refused: Counter[str], user: Any) -> None:
    """One LogEntry for the batch: what, which filter, how many, and why the others were not. Django's "Recent
    actions" shows it; it names no one record, so a record's own history page does not (its status, who handled
    it and when, and a replay's task id say what happened to it)."""
    message = "; ".join(
        [
            f"Bulk {action}: {done} of {len(ids)} matching {matching.described()}",
            *(f"{count} not: {reason}" for reason, count in refused.most_common()),
        ]
    )
    logger.info("%s", message)
    if user is None or getattr(user, "pk", None) is None:
        return  # a shell's command: no one to write a LogEntry for (it needs a user); the log line says it
    LogEntry.objects.create(
        user_id=user.pk,
        content_type_id=ContentType.objects.get_for_model(DeadLetter, for_concrete_model=False).pk,
        object_id=None,
        object_repr=f"{len(ids)} dead letters #{ids[0]}-#{ids[-1]}"[:200],
        action_flag=CHANGE,
        change_message=message,
    )


__all__ = ["ACTIONS", "BATCH", "TASK", "BulkResult", "Matching", "run", "start"]
