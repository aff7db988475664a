"""The message headers celery-guardrails adds: the whole contract, in one place.

Everything the extension puts on a message travels under ONE message header, ``guardrails``, whose value
is a flat mapping (an AMQP table on RabbitMQ, a JSON object on Redis)::

    headers["guardrails"] = {
        "v": 1,                 # schema version of this mapping (VERSION)
        "tenant": "acme",       # tenant id; absent when the message has no tenant
        "cid": "9f1c0c6e...",   # correlation id; every message gets one at publish
        "opts": {...},          # per-call guardrail options given to apply_async (JSON values only)
        "idem": "charge:42",    # the idempotency key made at publish (unscoped: task and tenant scope it)
        "attempt": 2,           # attempts consumed before this delivery (absent: 0)
        "later": 1,             # RetryLater re-deliveries so far (absent: 0)
        "deferred": 0,          # retry-budget / circuit-breaker deferrals so far (absent: 0)
        "outage": 0,            # times the guardrails store could not be reached for it (absent: 0)
        "busy": 0,              # waits for another delivery holding its idempotency key (absent: 0)
        "slot_wait": 0,         # waits for a concurrency slot (concurrency_key / exclusive_key) (absent: 0)
        "gave_up": ["..."],     # claim owners of earlier deliveries that gave up without releasing (a store
                                # outage): a claim one of them holds is taken over at once (at most 5)
        "dl": {...},            # a final failure whose dead letter is still to be written (its sinks were
                                # down): the message comes back only to record it (FinalFailure.to_dict());
                                # checked against the message when recorded (its tenant, owner, reason)
        "dl_tries": 2,          # ... and how many times writing it failed
        "hist": [{...}],        # the last HISTORY_LIMIT attempt records, oldest first (see below)
        "hist_n": 3,            # how many records were ever written (the list keeps the last 20)
        "sched": "nightly",     # scheduled work: the beat entry (schedule) this message runs a period of
        "period": 1796000000,   # ... and that period's due instant, epoch seconds (see
        celery_guardrails.scheduling.beat)
        "catchup": 1,           # ... dispatched late, as a catch-up (absent: on time)
        "ord": "account:42",    # ordered work: the ordering key made at publish (unscoped: task and tenant scope it)
        "ord_seq": 17,          # ... and the sequence number the store handed out for it then (1, 2, ...)
        "ord_wait": 3,          # waits for an earlier message of its key so far (absent: 0)
        "pub": 1796000000.25,   # when this message was published (epoch seconds; each re-publish sets it anew)
        "pv": 2,                # guarded tasks: the payload version its publisher sent (absent: 1)
        "redeliv": 2,           # quorum queues: deliveries of earlier messages of this run the broker counted
                                # (x-delivery-count), carried over a wait before the body ran (absent: 0)
        "rec_since": 1796000000.5,  # records not there yet: when its first delivery found the record missing
                                # (epoch seconds); record_wait is counted from it across re-publishes
        "rec_wait": 2,          # ... and the waits for it so far (absent: 0)
        "job": "0b7c...",       # a job a user polls (see celery_guardrails.jobs): its id, kept across retries,
                                # waits and replays; the worker writes the job's state as the message runs
        "replay_of": "5d1e...", # a replay of a dead letter: the task id of the failed run it replays (a key
                                # that run wrote failed is reopened by this message, whenever that write lands)
    }

An attempt record: ``{"n": 1, "start": "2026-11-30T08:00:00.123+00:00", "end": "...", "host": "celery@web1",
"exc": "requests.exceptions.HTTPError", "msg": "503 Server Error" (at most MESSAGE_LIMIT characters),
"class": "transient" | "permanent" | "retry_later" | "manual" | "deferred_budget" | "deferred_circuit" |
"store_unavailable",
"rule": "http:503", "delay": 3.2}`` (``delay`` is null when none was chosen; a failure the retry gate did not
retry also has ``"note"``: why, and what would make it retryable).

Version history:

* ``1`` (0.1): ``tenant``, ``cid``, ``opts``, ``idem``, ``attempt``, ``later``, ``deferred``, ``hist``,
  ``hist_n``.
* ``1`` (0.2): ``sched`` and ``period`` added (a release that does not know them runs the message as a
  plain one; the idempotency key ``idem`` of a scheduled message is its period key).
* ``1`` (0.3): ``outage``, ``busy`` and ``gave_up`` added, and the record class ``store_unavailable`` (a
  release that does not know them keeps them, and counts nothing for them); ``dl`` and ``dl_tries``, written
  since 0.1, are now part of the contract and checked.
* ``1`` (0.4): ``ord``, ``ord_seq`` and ``ord_wait`` added (see
  :mod:`celery_guardrails.guardrails.ordering`). Unlike other fields, a malformed ``ord`` / ``ord_seq`` (one
  without the other, a key that is not a valid key, a sequence that is not a whole number of at least 1) is
  not treated as missing: running it unordered would break the order it was published to keep, so the worker
  dead-letters it (``malformed_message``). A release that does not know them runs the message unordered.
* ``1`` (0.4): ``slot_wait`` added (a release that does not know it keeps it; its waits then count as
  ``later``).
* ``1`` (0.5): ``pub`` added, on every message a process with celery-guardrails publishes (guarded or not):
  the age of the oldest message of a queue and the time a message waited are read from it. A message without
  it (plain Celery) has an unknown age, never a zero one.

* ``1`` (0.6): ``pv`` added, on every message a ``GuardedTask`` publishes (see
  :mod:`celery_guardrails.guardrails.contract`); a retry or a replay keeps the version of the message it
  re-publishes. A malformed ``pv`` (not a whole number of at least 1) is not treated as missing: the message is
  dead-lettered (``malformed_message``), since running it as version 1 could misread its arguments. A release
  that does not know it runs every message.

* ``1`` (0.7): an attempt record may carry ``note`` (a release that does not know it keeps it in the history).
  Attempt records of a body's ``self.retry()`` are written by the worker as it handles the retry (class
  ``manual``), no longer by the publish.

* ``1`` (0.8): attempt records are checked field by field (:func:`attempt_records`: the last
  :data:`HISTORY_LIMIT`, text cut to its length, a field of the wrong type left out, a field of a newer release
  kept when it is a short scalar); the same checks apply to the history of a pending dead letter. A ``dl`` is
  no longer treated as missing when malformed: its message's body already ran to a final failure, so it is
  recorded, checked against the message (tenant, owner, reason, key, history; see
  :mod:`celery_guardrails.guardrails.pending_dead_letters`), as ``malformed_message`` when it does not pass.

* ``1`` (0.9): ``redeliv`` added (see :mod:`celery_guardrails.guardrails.poison`): on a quorum queue the
  broker's ``x-delivery-count`` is the poison counter, and a message put off before its body ran carries the
  count to its next message. A release that does not know it keeps it and counts in its store.

* ``1`` (0.9): ``catchup`` added on a scheduled period beat dispatched late (a release that does not know it
  keeps it; its runs then yield the overlap slot as any run does). Anything but ``1`` reads as absent.

* ``1`` (0.10): ``rec_since`` and ``rec_wait`` added (see :mod:`celery_guardrails.guardrails.records`): a
  message waiting for a record not there yet. A malformed ``rec_since`` is treated as missing (the wait starts
  again from that delivery). A release that does not know them keeps them; its waits then count as ``later``.

* ``1`` (0.11): ``job`` added (see :mod:`celery_guardrails.jobs`): the id of the job record the message works
  for. A malformed ``job`` (not 1 to 64 letters, digits, ``-`` or ``_``) is treated as missing: the message runs,
  its job is not written. A release that does not know it keeps it; its job then stays ``queued``.

* ``1`` (0.12): ``replay_of`` added on a replay's message (see :mod:`django_celery_guardrails.replay`): the task
  id of the dead-lettered run it replays. The record is durable (and can be replayed) a moment before that run
  writes its idempotency key failed; a replay that finds the key failed by that very run reopens it. Malformed
  (not 1 to 200 characters of text): treated as missing. A release that does not know it keeps it; its replay
  then runs only if the key was reopened before it was written failed (the replay reopens failed keys itself).

Compatibility rules:

* A message without the header (published by plain Celery, another service or an older release) is handled
  as "no tenant, no per-call options"; the worker gives it a fresh correlation id.
* A malformed field (wrong type, over-long, bad characters) is logged with the task id and treated as
  missing; it never crashes the worker.
* Fields this release does not know (from a newer release) are kept as they are when the message is
  re-published (retry), so a rolling deployment does not strip them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from celery_guardrails.exceptions import ContextError
from celery_guardrails.foundation.context import validate_correlation_id, validate_tenant

logger = logging.getLogger(__name__)

#: Name of the one message header the extension owns.
HEADER = "guardrails"
#: Schema version written by this release.
VERSION = 1

VERSION_FIELD = "v"
TENANT = "tenant"
CORRELATION_ID = "cid"
OPTIONS = "opts"
IDEMPOTENCY_KEY = "idem"
ATTEMPT = "attempt"
LATER = "later"
DEFERRED = "deferred"
OUTAGES = "outage"
BUSY = "busy"
SLOT_WAIT = "slot_wait"
GAVE_UP = "gave_up"
#: Owners kept in GAVE_UP at most (the newest).
GAVE_UP_LIMIT = 5
PENDING_DEAD_LETTER = "dl"
PENDING_TRIES = "dl_tries"
#: Fields a pending dead letter must have, as strings (the rest of a FinalFailure has defaults).
PENDING_REQUIRED = ("task_name", "task_id", "reason", "exc_type", "exc_message")
HISTORY = "hist"
HISTORY_TOTAL = "hist_n"
SCHEDULE = "sched"
PERIOD = "period"
CATCH_UP = "catchup"
ORDERING_KEY = "ord"
ORDERING_SEQUENCE = "ord_seq"
ORDERING_WAITS = "ord_wait"
PUBLISHED = "pub"
PAYLOAD_VERSION = "pv"
REDELIVERIES = "redeliv"
RECORD_SINCE = "rec_since"
RECORD_WAITS = "rec_wait"
JOB = "job"
REPLAY_OF = "replay_of"

#: Latest period a header may name (9999-12-31T23:59:59Z, as far as a datetime goes).
PERIOD_MAX = 253_402_300_799
#: Attempt records carried in a message at most (the oldest are dropped; HISTORY_TOTAL keeps counting).
HISTORY_LIMIT = 20
#: Characters of an exception message kept in an attempt record.
MESSAGE_LIMIT = 500
_COUNTERS = (
    ATTEMPT,
    LATER,
    DEFERRED,
    OUTAGES,
    BUSY,
    SLOT_WAIT,
    HISTORY_TOTAL,
    PENDING_TRIES,
    ORDERING_WAITS,
    REDELIVERIES,
    RECORD_WAITS,
)


def from_message_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The guardrails mapping found in raw message headers (a copy; empty when absent)."""
    value = (headers or {}).get(HEADER)
    return dict(value) if isinstance(value, Mapping) else {}


def from_request(request: Any) -> dict[str, Any]:
    """The guardrails mapping of the message a task request came from, sanitised (a fresh copy).

    Celery copies custom message headers onto the request as attributes (worker) or keeps them under
    ``request.headers`` (eager ``apply``); both are looked at. Malformed fields are dropped with a warning. A
    delivery reads it once, for every hook (:func:`celery_guardrails.runtime.delivery.view`); nothing is cached
    on the request here (``Task.push_request`` copies a request's attributes into the next one it pushes).
    """
    raw = getattr(request, HEADER, None)
    if raw is None:
        raw = (getattr(request, "headers", None) or {}).get(HEADER)
    task_id = getattr(request, "id", None)
    clean: dict[str, Any] = {}
    if isinstance(raw, Mapping):
        clean = sanitise(raw, task_id=task_id)
    elif raw is not None:
        logger.warning("Task %s: header %r is a %s, not a mapping; ignored", task_id, HEADER, type(raw).__name__)
    return clean


def sanitise(raw: Mapping[str, Any], *, task_id: str | None = None) -> dict[str, Any]:
    """Copy of ``raw`` with every known field checked; a bad one is logged and dropped."""
    clean = dict(raw)
    for field, check in ((TENANT, validate_tenant), (CORRELATION_ID, validate_correlation_id)):
        if field in clean:
            try:
                check(clean[field])
            except ContextError as exc:
                logger.warning(
                    "Task %s: malformed %r in header %r, treated as missing: %s", task_id, field, HEADER, exc
                )
                del clean[field]
    for field in _COUNTERS:
        value = clean.get(field)
        if field in clean and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            _drop(clean, field, task_id)
    if OPTIONS in clean and not isinstance(clean[OPTIONS], Mapping):
        _drop(clean, OPTIONS, task_id)
    if IDEMPOTENCY_KEY in clean and not isinstance(clean[IDEMPOTENCY_KEY], str):
        _drop(clean, IDEMPOTENCY_KEY, task_id)
    if SCHEDULE in clean and not (isinstance(clean[SCHEDULE], str) and 0 < len(clean[SCHEDULE]) <= 200):
        _drop(clean, SCHEDULE, task_id)
    period = clean.get(PERIOD)
    if PERIOD in clean and (isinstance(period, bool) or not isinstance(period, int) or not 0 <= period <= PERIOD_MAX):
        _drop(clean, PERIOD, task_id)
    gave_up = clean.get(GAVE_UP)
    if GAVE_UP in clean and not (
        isinstance(gave_up, list)
        and len(gave_up) <= GAVE_UP_LIMIT
        and all(isinstance(owner, str) and 0 < len(owner) <= 300 for owner in gave_up)
    ):
        _drop(clean, GAVE_UP, task_id)
    # A pending dead letter (dl) is kept whatever it holds: its message's body already ran to a final failure,
    # so it is never treated as missing (the body would run again); the guardrail that records it checks every
    # field (celery_guardrails.guardrails.pending_dead_letters), a null one only is dropped.
    if PENDING_DEAD_LETTER in clean and clean[PENDING_DEAD_LETTER] is None:
        _drop(clean, PENDING_DEAD_LETTER, task_id)
    if PUBLISHED in clean and published_at(clean) is None:
        _drop(clean, PUBLISHED, task_id)
    if RECORD_SINCE in clean and record_since(clean) is None:
        _drop(clean, RECORD_SINCE, task_id)
    if JOB in clean and job_id(clean) is None:
        _drop(clean, JOB, task_id)
    replayed = clean.get(REPLAY_OF)
    if REPLAY_OF in clean and not (isinstance(replayed, str) and 0 < len(replayed) <= 200):
        _drop(clean, REPLAY_OF, task_id)
    if HISTORY in clean:
        records = attempt_records(clean[HISTORY])
        if records is None:
            _drop(clean, HISTORY, task_id)
        else:
            clean[HISTORY] = records
    return clean


#: Attempt record fields this release reads as text, and the characters of each kept (longer text is cut).
RECORD_TEXT = {
    "start": 40,
    "end": 40,
    "host": 300,
    "exc": 300,
    "msg": MESSAGE_LIMIT,
    "class": 40,
    "rule": 200,
    "note": 1000,
}
#: Characters kept of a text field this release does not know (a newer release's), and such fields per record.
OTHER_TEXT = 1000
OTHER_FIELDS = 20


def attempt_records(value: Any) -> list[dict[str, Any]] | None:
    """The attempt records of ``value`` as the contract allows them, or None when it is not a list of mappings
    (the field is then malformed): the last :data:`HISTORY_LIMIT`; in each, ``n`` a whole number and ``delay`` a
    finite number of seconds (or null), the text fields (:data:`RECORD_TEXT`) text or null, cut to their length,
    a field of the wrong type left out; a field this release does not know kept when it is text (cut), a number,
    a bool or null. What a message carries in its history, and what a pending dead letter carries, pass here."""
    if not isinstance(value, list):
        return None
    kept = value[-HISTORY_LIMIT:]
    if not all(isinstance(record, Mapping) for record in kept):
        return None
    return [_attempt_record(record) for record in kept]


def _attempt_record(raw: Mapping[Any, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    others = 0
    for key, item in raw.items():
        if not isinstance(key, str):
            continue
        if key == "n":
            if _number(item) and isinstance(item, int) and item >= 0:
                record[key] = item
        elif key == "delay":
            if item is None or (_number(item) and item >= 0):
                record[key] = item
        elif key in RECORD_TEXT:
            if item is None or isinstance(item, str):
                record[key] = item if item is None else item[: RECORD_TEXT[key]]
        elif (
            others < OTHER_FIELDS and len(key) <= 40 and (item is None or isinstance(item, str | bool) or _number(item))
        ):
            others += 1
            record[key] = item[:OTHER_TEXT] if isinstance(item, str) else item
    return record


def _number(value: Any) -> bool:
    """Whether ``value`` is a number JSON carries as it is: not a bool, finite, at most 2**53 either way."""
    return not isinstance(value, bool) and isinstance(value, int | float) and -(2**53) <= value <= 2**53


def _drop(clean: dict[str, Any], field: str, task_id: str | None) -> None:
    logger.warning("Task %s: malformed %r in header %r, treated as missing", task_id, field, HEADER)
    del clean[field]


def published_at(header: Mapping[str, Any]) -> float | None:
    """When the message was published (epoch seconds), or None: absent, or not a finite positive number up to
    :data:`PERIOD_MAX`."""
    value = header.get(PUBLISHED)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= PERIOD_MAX:
        return None  # (NaN fails the comparison too)
    return float(value)


def record_since(header: Mapping[str, Any]) -> float | None:
    """When the message's wait for a record began (epoch seconds), or None: absent, or not a finite positive
    number up to :data:`PERIOD_MAX`."""
    value = header.get(RECORD_SINCE)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= PERIOD_MAX:
        return None
    return float(value)


def context(*, tenant: str | None, correlation_id: str | None) -> dict[str, Any]:
    """A new header carrying a tenant and a correlation id (either left out when empty), for a message published
    outside a guarded publish (a completion, a hand-off, a record of a row that never became a message)."""
    header: dict[str, Any] = {VERSION_FIELD: VERSION}
    if tenant:
        header[TENANT] = tenant
    if correlation_id:
        header[CORRELATION_ID] = correlation_id
    return header


_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def job_id(header: Mapping[str, Any]) -> str | None:
    """The id of the job the message works for (see :mod:`celery_guardrails.jobs`), or None: absent, or not 1 to
    64 letters, digits, ``-`` or ``_``."""
    value = header.get(JOB)
    return value if isinstance(value, str) and _JOB_ID.fullmatch(value) else None


def counter(header: Mapping[str, Any], field: str) -> int:
    """A counter field of a sanitised header (0 when absent)."""
    value = header.get(field, 0)
    return value if isinstance(value, int) else 0


def history(header: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The attempt records of a sanitised header, oldest first."""
    return [dict(record) for record in header.get(HISTORY) or ()]


def with_record(header: Mapping[str, Any], record: Mapping[str, Any], **counters: int) -> dict[str, Any]:
    """A copy of ``header`` with ``record`` appended to the bounded history and ``counters`` set."""
    records = [*history(header), dict(record)][-HISTORY_LIMIT:]
    total = max(counter(header, HISTORY_TOTAL), len(history(header))) + 1
    return {**header, **counters, HISTORY: records, HISTORY_TOTAL: total}


def call_options(header: Mapping[str, Any]) -> Mapping[str, Any]:
    """The per-call guardrail options stored in a guardrails mapping."""
    opts = header.get(OPTIONS)
    return opts if isinstance(opts, Mapping) else {}


def ordering(header: Mapping[str, Any]) -> tuple[str, int] | None:
    """The (ordering key, sequence) a message was published with; None when it carries neither. A malformed
    pair raises ValueError saying what is wrong (the caller dead-letters the message: see the version history)."""
    key, sequence = header.get(ORDERING_KEY), header.get(ORDERING_SEQUENCE)
    if key is None and sequence is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"header {HEADER!r}: ordering key {ORDERING_KEY!r} is missing or not a string: {key!r:.80}")
    if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
        raise ValueError(
            f"header {HEADER!r}: ordering sequence {ORDERING_SEQUENCE!r} is missing or not a whole number of at "
            f"least 1: {sequence!r:.80}"
        )
    return key, sequence


def payload_version(header: Mapping[str, Any]) -> int:
    """The payload version a message was published with (1 when absent). A malformed one raises ValueError
    saying what is wrong (the caller dead-letters the message: see the version history)."""
    value = header.get(PAYLOAD_VERSION, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"header {HEADER!r}: payload version {PAYLOAD_VERSION!r} is not a whole number of at least 1: {value!r:.80}"
        )
    return value
