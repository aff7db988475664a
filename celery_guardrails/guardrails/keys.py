"""Idempotency keys as a task makes them: rendered from its template over the bound arguments (or a callable),
checked, and scoped by task and tenant into what the store keeps. Used by idempotency and by the guardrails that
key by a template too (ordering, concurrency, pending dead letters, checkpoints).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from string import Formatter
from typing import Any

from celery_guardrails.exceptions import IdempotencyKeyError

#: Longest key a task may make (before scoping), in characters.
KEY_MAX_LENGTH = 200
#: Longest scoped key stored as it is; a longer one is stored as a prefix and a SHA-256.
STORED_MAX_LENGTH = 255


def render_key(
    task: Any,
    spec: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    option: str = "idempotency_key",
    error: type[Exception] = IdempotencyKeyError,
    extra: dict[str, Any] | None = None,
) -> str:
    """The key ``spec`` makes for these arguments (see the module docstring); raises ``error``
    (IdempotencyKeyError). ``option`` names the option in the messages (the ordering and concurrency
    guardrails make their keys the same way); ``extra``: more fields a template may name (a task argument
    of the same name wins), e.g. ``{tenant}`` for a concurrency key."""
    if callable(spec):
        try:
            key = spec(*args, **kwargs)
        except Exception as exc:
            raise error(f"{task.name}: {option} callable failed: {exc!r}") from exc
    else:
        arguments: dict[str, Any] = {}
        if _template_fields(spec):
            try:
                bound = task_signature(task).bind(*args, **kwargs)
            except TypeError as exc:
                raise error(f"{task.name}: arguments do not fit the task: {exc}") from exc
            bound.apply_defaults()
            arguments = {**(extra or {}), **bound.arguments}
        try:
            key = spec.format(**arguments)
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise error(f"{task.name}: {option} {spec!r} names {exc}, which is not an argument of the task") from exc
    return validate_key(task.name, key, what=option.replace("_", " "), error=error)


@functools.lru_cache(maxsize=1024)
def _template_fields(spec: str) -> bool:
    """Whether a key template names any field (parsed once per template: keys are made on every publish)."""
    return any(name for _, name, _, _ in Formatter().parse(spec))


_SIGNATURES: dict[type, inspect.Signature] = {}


def task_signature(task: Any) -> inspect.Signature:
    """The signature of the task's ``run`` (without ``self`` for bound tasks), computed once per class."""
    task = task._get_current_object() if hasattr(task, "_get_current_object") else task
    signature = _SIGNATURES.get(type(task))
    if signature is None:
        signature = _SIGNATURES[type(task)] = inspect.signature(task.run)
    return signature


def validate_key(
    task_name: str, key: Any, *, what: str = "idempotency key", error: type[Exception] = IdempotencyKeyError
) -> str:
    if not isinstance(key, str) or not key:
        raise error(f"{task_name}: {what} must be a non-empty str, got {key!r:.80}")
    if len(key) > KEY_MAX_LENGTH:
        raise error(f"{task_name}: {what} is {len(key)} characters, over {KEY_MAX_LENGTH}")
    if not key.isprintable() or key.split() != [key]:  # split() cuts at every whitespace character
        raise error(f"{task_name}: {what} {key!r:.80} has whitespace or control characters")
    return key


def scoped_key(task_name: str, tenant: str | None, key: str) -> str:
    """``task:tenant:key``; past STORED_MAX_LENGTH, a readable prefix and the SHA-256 of the whole."""
    scoped = f"{task_name}:{tenant or '-'}:{key}"
    if len(scoped) <= STORED_MAX_LENGTH:
        return scoped
    digest = hashlib.sha256(scoped.encode()).hexdigest()
    return f"{scoped[: STORED_MAX_LENGTH - 66]}~{digest}"
