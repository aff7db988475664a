"""The payload contract: what a message may carry, checked when it is published, and its version, checked when
it is delivered.

At publish (``GuardedTask.apply_async``, and so ``delay``, signatures and canvas, ``retry``, beat and replay),
in the caller, before anything is sent or reserved:

* **Entities**: a Django model instance or queryset among the arguments (at any depth of lists, tuples, sets
  and dicts) is refused with :class:`~celery_guardrails.exceptions.EntityInPayloadError`: send identifiers,
  not entities (the row may change or vanish before the worker reads it; its pickled state is stale).
* **Secrets and personal data**: an argument name (positional arguments are named from the task's signature)
  or a dict key at any depth that matches ``sensitive_keys`` is refused with
  :class:`~celery_guardrails.exceptions.SensitivePayloadError`. A name matches an entry when the entry's words
  (split at ``_``) appear in it in a row: ``password`` matches ``new_password`` and ``password_hash``,
  ``api_key`` matches ``stripe_api_key``, ``card_number`` does not match ``card_token``. A task that must carry
  one says why in ``allow_sensitive_payload`` (``guardrails_audit`` lists it).
* **Size**: the arguments serialised with the task's serializer, over ``max_payload_bytes`` (64 KiB), are
  refused with :class:`~celery_guardrails.exceptions.PayloadTooLargeError` naming the size: store the data and
  send a reference.
* **Depth**: arguments nested deeper than ``max_payload_depth`` levels of lists and dicts (100) are refused
  with :class:`~celery_guardrails.exceptions.PayloadTooDeepError`. A prefork worker hands the arguments to its
  child with pickle, which fails several hundred levels down and stops the worker's main process; on the worker
  such a message from another producer is dead-lettered ``malformed_message`` before it reaches the pool
  (:mod:`celery_guardrails.runtime.request`).
* **Version**: the message is stamped with the task's ``payload_version`` (header field ``pv``).

A re-publish (``retry``, a guardrail's wait, a replay: the message carries ``pv`` already, or it is the
delivery running now) is not checked again and keeps its version: its arguments were checked when first
published, and refusing a message in flight because a setting changed since would make its retry
unpublishable (it would come back and fail again, for ever).

On the worker, before any other guardrail acts on the message (only the context, a pending dead letter and
the poison check come first): a version the task does not accept (``accepts_versions``, default its own
``payload_version``; a message without ``pv`` is version 1) is dead-lettered with reason
``unknown_payload_version`` and never run. During a rollout, old workers dead-letter what new publishers send
instead of misreading it; once new workers run, ``replay_dead_letters(reason="unknown_payload_version")`` runs
those. A malformed ``pv`` is dead-lettered ``malformed_message``. The body reads the version it runs as
``self.request.payload_version`` (to read an older shape it still accepts).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from kombu.serialization import dumps

from celery_guardrails.exceptions import (
    EntityInPayloadError,
    PayloadContractError,
    PayloadTooDeepError,
    PayloadTooLargeError,
    SensitivePayloadError,
    UnknownPayloadVersionError,
)
from celery_guardrails.guardrails.sensitive import SENSITIVE_KEYS, matches
from celery_guardrails.options import APP, CALL, TASK, Option, TaskOptions, checks, declare, resolve
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import view
from celery_guardrails.runtime.outcomes import MALFORMED_MESSAGE, UNKNOWN_PAYLOAD_VERSION, attempt_record, fail_finally
from celery_guardrails.runtime.pipeline import Guardrail, Publication

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

#: Nesting levels of lists and dicts looked into (deeper values are not inspected).
MAX_DEPTH = 8
#: Values looked at per publish at most (a huge list is the size check's business, not a reason to walk it).
MAX_VALUES = 10_000


#: Default max_payload_depth: levels of lists and dicts in a task's arguments.
MAX_PAYLOAD_DEPTH = 100


#: The deepest max_payload_depth may be: well inside what pickle (prefork's hand-over to its child), the JSON
#: codecs and the record's walks take under Python's default recursion limit of 1,000.
DEPTH_CEILING = 400


def _versions(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"must be payload versions (whole numbers of at least 1), got {value!r:.80}")
    found = tuple(checks.positive_int(item) for item in value)
    if not found:
        raise ValueError("must name at least one payload version")
    return found


def _bytes_or_off(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value != 0 and not 256 <= value <= checks.COUNT_MAX):
        raise ValueError(f"must be a number of bytes of at least 256, or 0 to turn the limit off, got {value!r:.80}")
    return value


def _depth(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= DEPTH_CEILING:
        raise ValueError(f"must be a whole number of levels from 1 to {DEPTH_CEILING}, got {value!r:.80}")
    return value


def _key_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(f"must be a list of argument or key names, got {value!r:.80}")
    value = list(value)
    if not all(isinstance(name, str) for name in value):  # str(None) was the name "none"
        raise ValueError(f"names are strings, got {value!r:.120}")
    names = tuple(name.strip().lower().replace("-", "_") for name in value)
    if not all(re.fullmatch(r"[a-z0-9_]+", name) for name in names):
        raise ValueError(f"names are letters, digits and underscores, got {list(value)!r:.120}")
    return names


def _reason_or_none(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.strip()) < 10:
        raise ValueError(f"must say why, in a sentence (10 characters at least), got {value!r:.80}")
    return value.strip()


#: The options the payload contract reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="payload_version",
        default=1,
        doc="The version of the payload shape this task's publishers send (the header field pv). Raise it when "
        "the arguments change shape; workers that do not accept it dead-letter the message "
        "(unknown_payload_version) instead of running it wrongly.",
        check=checks.positive_int,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="accepts_versions",
        default=None,
        doc="The payload versions this task's workers run (a message without pv is version 1). None: only "
        "payload_version. During a rollout, a new worker accepts (1, 2) while old publishers still send 1.",
        check=_versions,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="max_payload_bytes",
        default=65536,
        doc="Largest serialised arguments a publish may send; larger is refused at publish "
        "(PayloadTooLargeError, naming the size): send a storage reference instead. 0: no limit.",
        check=_bytes_or_off,
        scopes=frozenset({CALL, TASK, APP}),
    ),
    Option(
        name="max_payload_depth",
        default=MAX_PAYLOAD_DEPTH,
        doc="Deepest nesting of lists and dicts the arguments may have (an argument that is a list of numbers "
        "is 1 level): deeper is refused at publish (PayloadTooDeepError) and, from another producer, "
        "dead-lettered malformed_message on delivery, never run. At most 400: a prefork worker hands the "
        "arguments to its child with pickle, which fails several hundred levels down.",
        check=_depth,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="sensitive_keys",
        default=SENSITIVE_KEYS,
        doc="Argument names and dict keys (at any depth) refused at publish as secrets or personal data "
        "(SensitivePayloadError): a name matches when its words (split at _) contain the entry's words. Add "
        "your own (email, phone, date_of_birth).",
        check=_key_names,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="allow_sensitive_payload",
        default=None,
        doc="A task that must carry a sensitive value says why here (a sentence); the guard then lets it "
        "through, and guardrails_audit lists the task and the reason.",
        check=_reason_or_none,
        scopes=frozenset({TASK}),
    ),
)


@functools.cache
def _entity_types() -> tuple[type, ...]:
    try:
        from django.db.models import Model, QuerySet
    except ImportError:  # not a Django project: no entity can be passed
        return ()
    return (Model, QuerySet)


def _running_id(task: Any) -> str | None:
    """The id of the delivery ``task`` runs now in this thread (None outside a run)."""
    request = task.request_stack.top if task.request_stack else None
    return getattr(request, "id", None) if request is not None else None


def _parameter_names(task: Any, count: int) -> list[str]:
    """Names of the task's first ``count`` positional parameters (fewer when the signature cannot say); read
    once per task."""
    names: list[str] | None = task.__dict__.get("_guardrails_positional")
    if names is None:
        try:
            parameters = list(inspect.signature(task.run).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        task.__dict__["_guardrails_positional"] = names
    return names[:count]


def _walk(
    value: Any, depth: int = 0, parts: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], Any, str | None, int]]:
    """(path parts, value, key, depth) of ``value`` and everything inside it; ``key`` is the dict key it is found
    under. The path stays a tuple of steps: it is written out only for an error (every publish walks this)."""
    yield parts, value, None, depth
    if depth >= MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield parts, key, str(key), depth
            yield from _walk(item, depth + 1, (*parts, key))
    elif isinstance(value, list | tuple | set | frozenset):
        for index, item in enumerate(value):
            yield from _walk(item, depth + 1, (*parts, index))


def _path(name: str, parts: tuple[Any, ...]) -> str:
    return name + "".join(f"[{part!r}]" for part in parts)


#: JSON bytes a str character may take at most (a character outside the BMP, escaped: two \uXXXX).
_CHAR_BYTES = 12


def _json_bound(value: Any, key: str | None) -> int | None:
    """An upper bound of the JSON bytes ``value`` adds beside its contents (a dict key when ``key`` is set);
    None for a type whose encoding this does not bound (the exact size is then measured)."""
    if key is not None:
        return _CHAR_BYTES * len(key) + 4
    if isinstance(value, str):
        return _CHAR_BYTES * len(value) + 3
    if value is None or isinstance(value, bool):
        return 6
    if isinstance(value, int):
        return len(str(value)) + 1
    if isinstance(value, float):
        return 26
    if isinstance(value, Mapping | list | tuple):
        return 3
    return None


def _leaves(signatures: Any, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    """The task signatures inside canvas signatures (chains, groups and chords opened, nested ones too)."""
    if depth > MAX_DEPTH:
        return
    for signature in signatures if isinstance(signatures, list | tuple) else (signatures,):
        if not isinstance(signature, Mapping):
            continue
        name, kwargs = signature.get("task"), signature.get("kwargs") or {}
        if name in ("celery.chain", "celery.group"):
            yield from _leaves(kwargs.get("tasks") or (), depth + 1)
        elif name == "celery.chord":
            yield from _leaves(kwargs.get("header") or (), depth + 1)
            yield from _leaves(kwargs.get("body") or (), depth + 1)
        else:
            yield signature


#: Containers' items looked at by :func:`nesting_over` at most: past it the depth is not known (a payload that
#: big is the size limit's business; on the worker, the pool's hand-over is guarded whatever it holds).
NESTING_BUDGET = 1_000_000
_CONTAINERS = (Mapping, list, tuple, set, frozenset)
#: Types that hold nothing: told apart by their type alone (an ABC's isinstance costs several times more, and
#: this check runs on every value of every message a worker takes).
SCALARS = frozenset({str, int, float, bool, type(None), bytes})
#: The containers JSON decodes to, told apart by their type alone too.
_BUILT_IN = frozenset({dict, list, tuple})
_SEQUENCES = frozenset({list, tuple})


def nesting_over(values: Iterator[Any] | tuple[Any, ...] | list[Any], limit: int) -> int | None:
    """The nesting depth reached past ``limit`` by any of ``values`` (a list of numbers is 1 level), or None when
    none goes deeper (or :data:`NESTING_BUDGET` items were looked at first). A loop, not a recursion: it takes
    any depth, and stops at the first level past the limit."""
    stack = [(value, 1) for value in values if _container(value)]
    seen = 0
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return depth
        seen += len(value)
        if seen > NESTING_BUDGET:
            return None
        kind = type(value)
        items = value.values() if kind is dict or (kind not in _SEQUENCES and isinstance(value, Mapping)) else value
        deeper = depth + 1
        for item in items:
            # Written out (not a generator into extend): this walk runs over every message a worker takes.
            kind = type(item)
            if kind in _BUILT_IN or (kind not in SCALARS and isinstance(item, _CONTAINERS)):
                stack.append((item, deeper))
    return None


def _container(value: Any) -> bool:
    kind = type(value)
    if kind in _BUILT_IN:
        return True
    return kind not in SCALARS and isinstance(value, _CONTAINERS)


def check_payload(task: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], call: Mapping[str, Any]) -> None:
    """The publish checks (entities, sensitive keys, depth, size) of ``task``'s arguments, raising what a publish
    would: for a message published later (``apply_async_on_commit``, the outbox), checked in the caller now."""
    contract = PayloadContract()
    options = TaskOptions(task=task, call=call)
    bound = contract._check_values(options, args, kwargs)
    contract._check_depth(task, args, kwargs, bound)
    contract._check_size(options, args, kwargs, bound)


class PayloadContract(Guardrail):
    """Checks what a message carries at publish and the version it was sent as at delivery (see the module
    docstring)."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        options = TaskOptions(task=task, call=publication.call)
        if headers.PAYLOAD_VERSION in publication.header or publication.task_id == _running_id(task):
            # A re-publish (a retry, a wait, a replay) of arguments checked when they were first published: the
            # same checks under settings changed since could refuse a message already in flight, and a retry
            # that cannot be published comes back and tries again, for ever.
            publication.header.setdefault(headers.PAYLOAD_VERSION, options["payload_version"])
            return
        bound = self._check_values(options, publication.args, publication.kwargs)
        self._check_depth(task, publication.args, publication.kwargs, bound)
        self._check_size(options, publication.args, publication.kwargs, bound)
        # The rest of a chain, a chord's body, callbacks: a worker publishes them after this message, where a
        # refusal would fail a task that succeeded. Guarded ones are checked now, with their tasks' settings.
        for leaf in _leaves(publication.later):
            later = task.app.tasks.get(leaf.get("task"))
            if later is not None and isinstance(getattr(later, "guardrails", None), tuple):
                args, kwargs = tuple(leaf.get("args") or ()), dict(leaf.get("kwargs") or {})
                later_options = TaskOptions(task=later)
                leaf_bound = self._check_values(later_options, args, kwargs)
                self._check_depth(later, args, kwargs, leaf_bound)
                self._check_size(later_options, args, kwargs, leaf_bound)
        publication.header[headers.PAYLOAD_VERSION] = options["payload_version"]

    def _check_values(self, options: TaskOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
        """Refuse entities and sensitive names; return an upper bound of the arguments' JSON size, or None when
        it cannot be bounded (a type of its own, too many values, too deep) and must be measured."""
        task = options.task
        entities = _entity_types()
        allowed = options["allow_sensitive_payload"]
        entries: tuple[str, ...] = () if allowed else options["sensitive_keys"]
        named = list(zip(_parameter_names(task, len(args)), args, strict=False))
        named += [(f"#{index}", value) for index, value in enumerate(args[len(named) :], len(named))]
        named += list(kwargs.items())
        seen = 0
        bound: int | None = 16  # the envelope's brackets
        for name, argument in named:
            if entries and not name.startswith("#") and (entry := matches(name, entries)):
                raise SensitivePayloadError(
                    task.name,
                    f"argument {name!r} looks like a secret or personal data (sensitive_keys entry {entry!r}): "
                    "send a reference the worker can resolve, or give the task an allow_sensitive_payload reason",
                )
            if bound is not None:
                bound += _CHAR_BYTES * len(name) + 4
            if type(argument) in SCALARS:  # nothing inside, nothing to walk: most arguments are ids and text
                seen += 1
                if seen > MAX_VALUES:
                    return None
                if bound is not None:
                    more = _json_bound(argument, None)
                    bound = None if more is None else bound + more
                continue
            for parts, value, key, depth in _walk(argument):
                seen += 1
                if seen > MAX_VALUES:
                    return None
                if key is not None:
                    if entries and (entry := matches(key, entries)):
                        raise SensitivePayloadError(
                            task.name,
                            f"key {key!r} in {_path(name, parts)} looks like a secret or personal data "
                            f"(sensitive_keys entry {entry!r}): send a reference, or give the task an "
                            "allow_sensitive_payload reason",
                        )
                elif entities and isinstance(value, entities):
                    kind = type(value).__name__
                    raise EntityInPayloadError(
                        task.name,
                        f"{_path(name, parts)} is a {kind}: send identifiers, not entities (its primary key, and "
                        "let the worker read the row as it is when the task runs)",
                    )
                if bound is not None:
                    more = _json_bound(value, key)
                    deeper = depth >= MAX_DEPTH and key is None and isinstance(value, Mapping | list | tuple) and value
                    bound = None if more is None or deeper else bound + more
        return bound

    def _check_depth(
        self, task: GuardedTask, args: tuple[Any, ...], kwargs: Mapping[str, Any], bound: int | None
    ) -> None:
        limit = resolve(task, "max_payload_depth", {})
        if bound is not None and limit > MAX_DEPTH:
            return  # _check_values saw every value, none deeper than MAX_DEPTH: no second walk on the publish path
        depth = nesting_over((*args, *kwargs.values()), limit)
        if depth is not None:
            raise PayloadTooDeepError(
                task.name,
                f"its arguments are nested more than {depth - 1} levels deep, over max_payload_depth {limit}: a "
                "prefork worker could not hand them to its child; flatten them, or store the data and send a "
                "reference",
            )

    def _check_size(
        self, options: TaskOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any], bound: int | None = None
    ) -> None:
        task = options.task
        limit = options["max_payload_bytes"]
        if not limit:  # 0: no limit
            return
        serializer = task.serializer or task.app.conf.task_serializer
        if bound is not None and bound <= limit and serializer == "json":
            return  # surely within the limit: no second serialisation on the publish path
        try:
            _, _, body = dumps((args, kwargs), serializer=serializer)  # type: ignore[no-untyped-call]
        except Exception:  # Celery's own publish will raise the serializer's error, with its message
            return
        if len(body) > limit:
            raise PayloadTooLargeError(
                task.name,
                f"its arguments are {len(body):,} bytes serialised ({serializer}), over max_payload_bytes "
                f"{limit:,}: store the data (a file, a row, an object store) and send a reference to it",
            )

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        if request.called_directly or request.is_eager:
            return  # a call in the caller's process: the code that runs is the code that called
        seen = view(task)
        options = seen.options
        try:
            version = headers.payload_version(seen.header)
        except ValueError as exc:
            self._refuse(task, PayloadContractError(task.name, f"malformed payload version: {exc}"), MALFORMED_MESSAGE)
        accepted = options["accepts_versions"] or (options["payload_version"],)
        request.payload_version = version  # the body reads it to handle an older shape it still accepts
        if version not in accepted:
            error = UnknownPayloadVersionError(
                task.name,
                f"payload version {version} is not one this worker accepts {tuple(accepted)}: dead-lettered unrun; "
                "replay it once workers that accept it run",
            )
            self._refuse(task, error, UNKNOWN_PAYLOAD_VERSION)

    def _refuse(self, task: GuardedTask, error: PayloadContractError, reason: str) -> NoReturn:
        record = attempt_record(task, kind="permanent", rule="payload_contract", exc=error)
        # Before Retries read the history onto the request: from the header.
        earlier = headers.history(view(task).header)
        fail_finally(task, error, reason=reason, history=[*earlier, record])
