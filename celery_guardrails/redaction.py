"""Redaction: secrets and personal data never reach a retained record.

Before a dead letter is stored, every value under a key whose name matches one of ``redact_keys``
(case-insensitive, anywhere in the name: ``password``, ``db_password``, ``X-Auth-Token``) is replaced by
``REDACTED``, in nested mappings and lists too. Positional arguments are matched by their parameter name in
the task's signature. Values that cannot be stored as JSON are kept as their ``repr`` with a flag.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "[redacted]"

#: Default key fragments redacted (case-insensitive substrings).
DEFAULT_REDACT_KEYS = (
    "password",
    "passwd",
    "secret",
    "token",
    "authorization",
    "api_key",
    "apikey",
    "card",
    "cvv",
    "ssn",
    "iban",
    "credential",
    "private_key",
)


def _matcher(keys: Iterable[str]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(k) for k in keys) or r"(?!x)x", re.IGNORECASE)


def redact(value: Any, keys: Iterable[str] = DEFAULT_REDACT_KEYS) -> Any:
    """A copy of ``value`` with the values of matching keys replaced, at any depth."""
    return _redact(value, _matcher(keys))


def _redact(value: Any, matcher: re.Pattern[str]) -> Any:
    if isinstance(value, Mapping):
        return {
            k: REDACTED if isinstance(k, str) and matcher.search(k) else _redact(v, matcher) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact(v, matcher) for v in value]
    return value


def redact_arguments(
    run: Any, args: Any, kwargs: Any, keys: Iterable[str] = DEFAULT_REDACT_KEYS
) -> tuple[Any, dict[str, Any], bool]:
    """(args, kwargs, stored_as_repr): redacted, JSON-ready arguments of a task call."""
    matcher = _matcher(keys)
    args, kwargs = list(args or ()), dict(kwargs or {})
    try:
        names = [
            p.name
            for p in inspect.signature(run).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        names = []
    clean_args = [
        REDACTED if i < len(names) and matcher.search(names[i]) else _redact(a, matcher) for i, a in enumerate(args)
    ]
    clean_kwargs = _redact(kwargs, matcher)
    try:
        json.dumps([clean_args, clean_kwargs])
    except (TypeError, ValueError):
        # Not JSON: keep a (redacted) repr so the record still says what it was; replay is not possible.
        return [repr(clean_args)[:2000]], {"repr": repr(clean_kwargs)[:2000]}, True
    return clean_args, clean_kwargs, False
