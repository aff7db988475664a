"""The value checks options share: each takes a raw value and returns it checked, or raises ValueError saying
what is wrong (the caller names the key). A check used by one owner only lives beside that owner's options.

A refused value is shown in the message cut to 80 characters, unless it may be a secret: then only its kind
(:func:`kind`) or, for a URL, its masked form (:func:`masked`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options.loading import load

#: Largest count an option takes: what a database integer column and a Lua number hold exactly.
COUNT_MAX = 2**31 - 1
#: Longest duration an option takes (100 years, in seconds): a longer one overflows the date arithmetic it feeds
#: (now - dead_letter_retention before the year 1) and Redis expiries.
SECONDS_MAX = 100 * 365 * 24 * 3600.0
#: A team, person or provider name (owner, owners' values, dependency, a schedule's owner).
NAME = re.compile(r"[\w.:-]{1,100}")


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r:.80}")
    return value


def callable_or_path(value: Any) -> Any:
    """A callable or a dotted path to one; the path is imported as a worker starts (see ``import_paths``)."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) and "." in value:
        return value
    raise ValueError(f"must be a callable or a dotted path 'package.module.name', got {value!r:.80}")


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= COUNT_MAX:
        raise ValueError(f"must be a whole number from 1 to {COUNT_MAX}, got {value!r:.80}")
    return value


def non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= COUNT_MAX:
        raise ValueError(f"must be a whole number from 0 to {COUNT_MAX}, got {value!r:.80}")
    return value


def finite(value: Any) -> bool:
    """Whether ``value`` is a real, finite number (not a bool): NaN passes every comparison check as False, so
    ``nan <= 0`` let it through, and infinity makes every sum and sleep with it infinite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # a whole number past the largest float (10**400): as good as infinite
        return False


def seconds(value: Any) -> float:
    if not finite(value) or not 0 < value <= SECONDS_MAX:
        raise ValueError(f"must be a positive finite number of seconds, at most 100 years, got {value!r:.80}")
    return float(value)


def seconds_or_off(value: Any) -> float:
    if not finite(value) or not 0 <= value <= SECONDS_MAX:
        raise ValueError(f"must be a finite number of seconds up to 100 years, 0 to turn it off, got {value!r:.80}")
    return float(value)


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check``, with None accepted as "not set" (for options whose default None means something)."""

    def checked(value: Any) -> Any:
        return None if value is None else check(value)

    return checked


def choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}, got {value!r:.80}")
        return str(value)

    return check


def name(value: Any) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"must be a name of 1 to 100 letters, digits or . : - _, got {value!r:.80}")
    return value


def exception_types(value: Any) -> tuple[type[BaseException], ...]:
    items = value if isinstance(value, list | tuple) else (value,)
    types = []
    for item in items:
        try:
            loaded = load(item) if isinstance(item, str) else item
        except ConfigurationError as exc:  # named by the option's key, not the path's
            raise ValueError(exc.problem) from None
        if not (isinstance(loaded, type) and issubclass(loaded, BaseException)):
            raise ValueError(f"must be exception classes or dotted paths to them, got {item!r:.80}")
        types.append(loaded)
    return tuple(types)


def key_spec(value: Any) -> Any:
    """A key option (idempotency, ordering, concurrency): a str.format template, a key, or a callable."""
    if callable(value) or (isinstance(value, str) and value.strip()):
        return value
    # Not echoed: a key given per call is a value (it may hold anything the caller put in it).
    raise ValueError(f"must be a str.format template, a key, or a callable, got {kind(value)}")


def kind(value: Any) -> str:
    """What a refused value is, without what it holds: for values that may be secrets."""
    if isinstance(value, str | bytes):
        return f"{'an empty ' if not value else 'a '}{type(value).__name__}" + (" of spaces" if value.isspace() else "")
    return "None" if value is None else f"a {type(value).__name__}"


def masked(url: str) -> str:
    """``url`` with its credentials replaced by ``***``: the user info of every address (a cluster URL has
    several) and the value of every query parameter whose name says password, secret, token or key. What a
    validator may show of a URL."""
    url = re.sub(r"//[^/@?#]*@", "//***@", url)
    return re.sub(r"([?&][^=&#]*(?:pass|secret|token|key|auth)[^=&#]*=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)
