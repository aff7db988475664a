"""Dead letters: every final failure is recorded durably, with an owner, before its message is acked.

Sinks (``dead_letter_sinks``, in order, all of them must succeed):

* ``"django"``: the ``DeadLetter`` model of the Django app (the default when it is installed), browsable and
  replayable in the Django admin;
* ``"redis"`` (the store's Redis) or a Redis URL: an entry in the stream ``guardrails:dead_letters``
  (``XADD``, one JSON field ``record``), for deployments without Django. The stream keeps about the newest
  :data:`STREAM_MAXLEN` entries; the entry and its per-task marker are written by one script. The markers
  are named ``{guardrails:dead_letters}:seen:<task id>``: the stream's name as a Redis Cluster hash tag, so
  marker and stream share a slot.

Arguments are redacted first (:mod:`celery_guardrails.foundation.redaction`); with ``seal_keys`` set, the originals
travel with the record only as a sealed copy (:mod:`celery_guardrails.foundation.sealing`), for replay. Recording is
idempotent per task id: a message recorded and then delivered again (its worker died before the ack) does
not make a second record.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.foundation.fingerprints import fingerprint
from celery_guardrails.foundation.redaction import DEFAULT, exception_name, exception_text, safe_repr
from celery_guardrails.foundation.sealing import sealer_for
from celery_guardrails.options import APP, TASK, Option, app_value, checks, declare
from celery_guardrails.runtime import delivery
from celery_guardrails.runtime.final_failure import FinalFailure
from celery_guardrails.stores import django_apps_installed, redis_url, store_url
from celery_guardrails.stores.redis_client import SCHEMES

logger = logging.getLogger(__name__)

STREAM = "guardrails:dead_letters"
#: Entries the Redis stream keeps, about (``XADD MAXLEN ~``): the oldest are trimmed.
STREAM_MAXLEN = 100_000
#: Seconds the Redis sink remembers that a task id was recorded (30 days).
MARKER_TTL = 30 * 24 * 3600
#: A task's marker: the stream's name as hash tag (it has no braces, so both hash to the same slot).
MARKER = "{" + STREAM + "}:seen:"
#: The marker's name before the hash tag, still honoured (it lives MARKER_TTL: drop this after that long).
LEGACY_MARKER = STREAM + ":seen:"

# KEYS: marker, stream. ARGV: record, marker ttl, maxlen. The entry, then its marker: a script that fails
# part-way (nothing but the XADD can) leaves neither, so a message is never "recorded already" unrecorded.
_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'record', ARGV[1])
redis.call('SET', KEYS[1], 1, 'EX', ARGV[2])
return 1
"""


#: Newest stream entries :meth:`RedisStreamSink.find` reads.
FIND_SCAN = 5000

#: Bytes of JSON a record's arguments may take (64 KiB); bigger ones are kept as a cut repr, not replayable.
ARGUMENTS_LIMIT = 64 * 1024
#: Characters of a traceback kept.
TRACEBACK_LIMIT = 20_000


#: Levels of lists and dicts a stored value keeps; deeper ones are replaced by :data:`CUT_DEEP` (the redaction
#: cuts arguments sooner: this bounds every other value a record takes, e.g. a header another producer wrote).
STORABLE_DEPTH = 100
#: What stands for a value nested deeper than a record keeps.
CUT_DEEP = "[cut: nested too deep to keep]"


def _owners(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map task-name patterns to owner names, got {value!r:.80}")
    for pattern, owner in value.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ValueError(f"task-name patterns are non-empty strings, got {pattern!r:.80}")
        try:  # the rule of the task-level owner: one rule for every owner name
            checks.name(owner)
        except ValueError as exc:
            raise ValueError(f"pattern {pattern!r:.80}: the owner {exc}") from None
    return dict(value)


def _sinks(value: Any) -> list[str] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if isinstance(names, Mapping) or not isinstance(names, list | tuple):
        raise ValueError(f"must be a list of sinks ('django', 'redis' or Redis URLs), got {checks.kind(value)}")
    if not names:  # no sink: a final failure would be acked with nothing recorded
        raise ValueError("must name at least one sink: with none, a final failure would be recorded nowhere")
    for number, name in enumerate(names, start=1):
        if name in ("django", "redis"):
            continue
        if not isinstance(name, str) or not name.startswith(SCHEMES):
            shown = f"{checks.masked(name)!r:.80}" if isinstance(name, str) else checks.kind(name)
            raise ValueError(f"sink {number}: sinks are 'django', 'redis' or Redis URLs, got {shown}")
        try:
            redis_url(name)
        except ValueError as exc:
            raise ValueError(f"sink {number}: {exc}") from None
    return list(names)


#: The options dead-letter recording reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="owner",
        default=None,
        doc="Who owns the task's dead letters and is alerted about them (a team or person name).",
        check=checks.name,
        scopes=frozenset({TASK}),
    ),
    Option(
        name="owners",
        default={},
        doc="App-wide owners by task-name pattern: {'payments.*': 'payments'} (fnmatch, first match).",
        check=_owners,
        scopes=frozenset({APP}),
    ),
    Option(
        name="dead_letter_sinks",
        default=None,
        doc="Where dead letters are recorded: 'django', 'redis' (the store's Redis stream) or Redis URLs. "
        "Default: ['django'] with the Django app, else ['redis'].",
        check=_sinks,
        scopes=frozenset({APP}),
    ),
    Option(
        name="dead_letter_retention",
        default=90 * 24 * 3600.0,
        doc="Seconds a discarded or resolved dead letter is kept (90 days); open ones are never pruned.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
)


def storable(value: Any, depth: int = 0) -> Any:
    """``value`` with what a database refuses in text written out instead: NUL as ``\\x00`` (PostgreSQL refuses
    it in text and JSON), a lone surrogate as ``\\udXXX`` (not UTF-8); dict keys made text; values nested deeper
    than :data:`STORABLE_DEPTH` cut. The record keeps what the message held, escaped, instead of failing for ever."""
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\\x00")
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict | list | tuple) and depth >= STORABLE_DEPTH:
        return CUT_DEEP
    if isinstance(value, dict):
        return {storable(k if isinstance(k, str) else str(k)): storable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item, depth + 1) for item in value]
    return value


def _identity(failure: FinalFailure) -> dict[str, Any]:
    """Who, what and why of a record (everything but the message's contents and its texts)."""
    return {
        "task_name": failure.task_name,
        "task_id": failure.task_id,
        "queue": failure.queue or "",
        "routing_key": failure.queue or "",
        "tenant": failure.tenant or "",
        "correlation_id": failure.correlation_id or "",
        "idempotency_key": failure.idempotency_key or "",
        "reason": failure.reason,
        "exc_type": failure.exc_type,
        "attempts": failure.attempts,
        "first_failed_at": failure.first_failed_at,
        "last_failed_at": failure.last_failed_at,
        "owner": failure.owner or "",
    }


#: A record's contents, left out of a record cut to what can be stored (:func:`cut_record`, :func:`minimal`).
NO_CONTENTS: dict[str, Any] = {
    "args": [],
    "kwargs": {},
    "arguments_are_repr": True,
    "header": {},
    "history": [],
    "traceback": "",
}


def record_fields(task: Any, failure: FinalFailure) -> dict[str, Any]:
    """The record of ``failure`` as stored: redacted, JSON-ready, NUL escaped, arguments capped in size.

    Every text and value goes through the task's redaction here, whichever path made the failure (a header-carried
    one, a malformed message's): redacting what was redacted already changes nothing."""
    redaction = delivery.redaction(task)
    args, kwargs, as_repr = redaction.arguments(task.run, failure.args, failure.kwargs)
    size = len(json.dumps([args, kwargs], default=str))
    if size > ARGUMENTS_LIMIT:  # a huge argument is not kept whole in a retained record
        args, kwargs, as_repr = [safe_repr(args)[:2000]], {"repr": safe_repr(kwargs)[:2000], "bytes": size}, True
    fields: dict[str, Any] = storable(
        {
            **_identity(failure),
            "args": args,
            "kwargs": kwargs,
            "arguments_are_repr": as_repr,
            "header": redaction.value(failure.header).value,
            "exc_message": redaction.text(failure.exc_message),
            "traceback": redaction.text(failure.traceback, keep=TRACEBACK_LIMIT, tail=True),
            "history": redaction.shown(failure.history).value,
        }
    )
    fields["fingerprint"] = _fingerprint(fields)
    fields["sealed"] = _sealed(task, failure)
    return fields


def _fingerprint(fields: dict[str, Any]) -> str:
    """The record's cause, from what it keeps (:mod:`celery_guardrails.foundation.fingerprints`); "" (not grouped)
    when it cannot be made: a grouping never costs the record."""
    try:
        return fingerprint(
            task_name=str(fields.get("task_name", "")),
            exc_type=str(fields.get("exc_type", "")),
            exc_message=str(fields.get("exc_message", "")),
            traceback=str(fields.get("traceback", "")),
        )
    except Exception:
        logger.exception("Dead letter of %s recorded without a fingerprint", fields.get("task_id"))
        return ""


def _sealed(task: Any, failure: FinalFailure) -> str:
    """The failure's sealed copy ("" without seal keys). A seal that cannot be made never costs the record."""
    try:
        sealer = sealer_for(task.app)
        if sealer is None:
            return ""
        return sealer.seal(args=failure.args, kwargs=failure.kwargs, header=failure.header, record=failure) or ""
    except Exception:
        logger.exception("Dead letter of %s[%s] recorded without a sealed copy", failure.task_name, failure.task_id)
        return ""


def cut_record(task: Any, failure: FinalFailure, error: BaseException) -> dict[str, Any]:
    """The record of ``failure`` when its whole record could not be built (a walk that failed, a value the
    encoder refused): who, what and why, none of the message's contents, and the sealed copy (replay reads the
    original from it). The reason it was cut is in its exception message (already redacted: fail_finally)."""
    note = f"[record cut: {exception_name(error)} while building it] "
    fields: dict[str, Any] = storable(
        {**_identity(failure), **NO_CONTENTS, "exc_message": note + str(failure.exc_message)[:500]}
    )
    # Of the failure, not of the note: a record cut is grouped with the whole records of its cause.
    fields["fingerprint"] = _fingerprint({**fields, "exc_message": storable(str(failure.exc_message)[:500])})
    fields["sealed"] = _sealed(task, failure)
    return fields


def minimal(fields: dict[str, Any], error: BaseException) -> dict[str, Any]:
    """What is left of a record a sink refused as data: who, what and why, without the message's contents
    (arguments, header, history, traceback) or its sealed copy, and the refusal in the exception message."""
    note = f"[record cut: the store refused it: {DEFAULT.text(exception_text(error), keep=200)}] "  # it may quote data
    return {
        **fields,
        **NO_CONTENTS,
        "sealed": "",
        "exc_message": storable(note + str(fields.get("exc_message", ""))[:300]),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenCounts:
    """A sink's open records, counted by (owner, task name)."""

    counts: Counter[tuple[str, str]]
    #: Only the newest records were read (the sink holds more than the limit counted).
    truncated: bool = False


class Sink(Protocol):
    """Where dead letters are recorded: the Redis stream here, the Django table registered by the Django app
    (:func:`register_sink`)."""

    def record(self, fields: dict[str, Any]) -> bool:
        """Store the record durably; True if new, False if this task id was recorded already."""

    def find(self, task_id: str) -> dict[str, Any] | None:
        """The record of ``task_id``, or None."""

    def open_counts(self, *, limit: int) -> OpenCounts:
        """The open records by (owner, task name), of the newest ``limit`` at most where reading all is dear."""

    def replay(self, task_ids: list[str], *, reason: str, app: Any) -> dict[str, str]:
        """Replay the records of ``task_ids`` with ``reason``; their replays' task ids, by original task id."""


#: Sinks the core does not make itself, by name (``"django"``: registered by the Django app when it is ready).
_SINK_MAKERS: dict[str, Callable[[], Sink]] = {}


def register_sink(name: str, make: Callable[[], Sink]) -> None:
    """Make the sink ``name`` of ``dead_letter_sinks`` with ``make`` (the Django app registers ``"django"``
    in its ``ready()``: the core does not import it)."""
    _SINK_MAKERS[name] = make


def _sink(url: str, *, timeout: float) -> Sink:
    make = _SINK_MAKERS.get(url)
    if make is not None:
        return make()
    if url == "django":
        raise ConfigurationError(
            "dead_letter_sinks",
            "the 'django' sink needs the Django app django_celery_guardrails in INSTALLED_APPS, set up "
            "(django.setup(), which a Django project's worker and web process do)",
        )
    return RedisStreamSink(url, timeout=timeout)


class RedisStreamSink:
    def __init__(self, url: str, *, timeout: float) -> None:
        from celery_guardrails.stores.redis_client import connect

        self.url = url
        # The store's timeouts: a half-open connection must not hold the message (and its worker) for ever.
        self.client = connect(url, timeout=timeout)
        self._record = self.client.register_script(_RECORD)

    def record(self, fields: dict[str, Any]) -> bool:
        import redis

        from celery_guardrails.stores.redis_client import failure

        task_id = fields["task_id"]
        try:  # one entry per task id
            # Recorded by a release before the hash tag (another slot: read on its own; nothing writes it now)
            if self.client.exists(LEGACY_MARKER + task_id):
                return False
            record = _encoded(fields)
            new = self._record(keys=[MARKER + task_id, STREAM], args=[record, MARKER_TTL, STREAM_MAXLEN])
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            # the store's rule: an outage comes back, a refusal is final
            raise failure("dead-letter stream", self.url, exc) from exc
        return bool(new)

    def find(self, task_id: str) -> dict[str, Any] | None:
        # The newest entries (a test kit's, a status line's question: the record just written).
        for _, entry in self.client.xrevrange(STREAM, count=FIND_SCAN):
            record = json.loads(entry[b"record"])
            if record.get("task_id") == task_id:
                return dict(record)
        return None

    def open_counts(self, *, limit: int) -> OpenCounts:
        # Every entry counts as open: the stream keeps no replays.
        counts: Counter[tuple[str, str]] = Counter()
        read, top = 0, "+"
        while read < limit:
            page = self.client.xrevrange(STREAM, max=top, min="-", count=min(1000, limit - read))
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
                    logger.warning("Dead-letter stream entry %r is not a record; not counted", entry_id)
        return OpenCounts(counts=counts, truncated=read >= limit and int(self.client.xlen(STREAM)) > read)

    def replay(self, task_ids: list[str], *, reason: str, app: Any) -> dict[str, str]:
        return {}  # the stream's records are read and replayed by hand


def _encoded(fields: dict[str, Any]) -> str:
    """The stream entry's JSON; the record cut (:func:`minimal`) when the whole one cannot be encoded."""
    try:
        return json.dumps(fields, default=str)
    except Exception as refused:  # a value nested too deep, a circular one, a default=str that raised
        logger.error("Dead letter of %s not encodable (%r); recording it cut", fields.get("task_id"), refused)
        return json.dumps(minimal(fields, refused), default=str)


def sinks_for(app: Any) -> list[Sink]:
    """The app's sinks, made once per app and setting (a Redis sink holds a client and its pool)."""
    names = app_value(app, "dead_letter_sinks")
    if names is None:
        names = ["django"] if django_apps_installed() else ["redis"]
    urls = tuple(store_url(app) if name == "redis" else name for name in names)
    cached = getattr(app, "_guardrails_sinks", None)
    if cached is not None and cached[0] == urls:
        return cached[1]  # type: ignore[no-any-return]
    timeout = app_value(app, "store_timeout")
    sinks = [_sink(url, timeout=timeout) for url in urls]
    app._guardrails_sinks = (urls, sinks)
    return sinks


def record(task: Any, failure: FinalFailure) -> bool:
    """Record ``failure`` in every sink; raises StoreError when one cannot; True when it was new.

    Whatever the message holds, a record is written: one whose fields cannot be built (any exception at all,
    from a walk, the encoder or a repr) is recorded cut (:func:`cut_record`), one a sink refuses as data is
    recorded minimal (:func:`minimal`). What is left to raise is a sink that cannot be reached."""
    try:
        fields = record_fields(task, failure)
    except Exception as error:
        logger.exception("Dead letter of %s[%s]: not built whole; recording it cut", failure.task_name, failure.task_id)
        fields = cut_record(task, failure, error)
    new = [sink.record(fields) for sink in sinks_for(task.app)]
    return any(new)
