"""Redaction: secrets and personal data never reach a retained record.

Before a dead letter is stored, every value under a key whose name matches one of ``redact_keys``
(case-insensitive, anywhere in the name: ``password``, ``db_password``, ``X-Auth-Token``) is replaced by
``REDACTED``, in nested mappings and lists too. Positional arguments are matched by their parameter name in
the task's signature. Values that cannot be stored as JSON are kept as their ``repr`` with a flag.

Free text (an exception's message, a traceback, the messages of the attempt history) is redacted by
:func:`redact_text`: ``<key>=<value>``, ``<key>: <value>`` and ``"<key>": "<value>"`` for a matching key,
``Bearer``/``Basic`` credentials, and card numbers (13 to 19 digits, spaces or dashes between, that pass
the Luhn check).
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


_CREDENTIALS = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{6,}", re.IGNORECASE)
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])")


def _luhn(digits: str) -> bool:
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char) * (2 if i % 2 else 1)
        total += value - 9 if value > 9 else value
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"[ -]", "", match.group())
    return REDACTED if 13 <= len(digits) <= 19 and _luhn(digits) else match.group()


def redact_text(text: str, keys: Iterable[str] = DEFAULT_REDACT_KEYS) -> str:
    """``text`` with the values of matching ``key=value`` / ``key: value`` pairs, credentials and card numbers
    replaced by ``REDACTED`` (see the module docstring)."""
    if not text:
        return text
    text = _CREDENTIALS.sub(lambda m: f"{m.group(1)} {REDACTED}", text)  # first: "Authorization: Bearer x"
    names = "|".join(re.escape(k) for k in keys)
    if names:
        # A key is tried only where a word starts (the lookbehind): tried at every character of a long run of
        # word characters, the pattern took quadratic time (20k characters of an exception: 25 s).
        pairs = re.compile(
            rf"""(?<![\w.-])(["']?[\w.-]*(?:{names})[\w.-]*["']?\s*[:=]\s*)("[^"]*"|'[^']*'|[^\s,;&)}}\]]+)""",
            re.IGNORECASE,
        )
        text = pairs.sub(lambda m: m.group(1) + REDACTED, text)
    return _CARD.sub(_card, text)


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
