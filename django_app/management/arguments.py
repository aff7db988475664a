"""What the management commands accept, checked in one place: ages, moments, choices, numbers and text.

Each check raises :class:`~django.core.management.base.CommandError` with one line naming the option and
what it takes; Django prints it as ``CommandError: ...`` and exits 1, never with a traceback. Commands take
their values as text and check them in ``handle`` (an error raised while argparse converts a value would end
in a traceback: Django catches CommandError around ``handle`` only).

Bounds, so that no value reaches a calculation or a query that cannot take it: an age is at most
:data:`MAX_AGE` (100 years: ``99999999999999999999d`` overflowed datetime), a moment lies in the years
:data:`YEARS`, a whole number is ASCII digits within its option's range (``"²".isdigit()`` is true, ``int("²")``
fails; a LIMIT past a bigint fails in the database), and text that is compared with or written into a column
holds no NUL (PostgreSQL refuses it) and fits the column. Values are shown in errors by ``repr``: control and
invisible characters escaped.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.core.management.base import CommandError
from django.utils import timezone

from ..display import escape

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
#: A whole number as an id or a count is written: ASCII digits, at most 18 (within a bigint; ``int()`` refuses more
#: than 4,300 digits with a ValueError).
DIGITS = re.compile(r"[0-9]{1,18}")
AGE_HELP = "an age such as 90s, 30m, 2h, 7d or 2w (a bare number is seconds)"
#: The longest age an option takes.
MAX_AGE = timedelta(days=36_525)
#: The years a moment may name: a day or a time zone either side stays inside datetime's years 1 to 9999.
YEARS = range(2, 9999)


def age(value: str, *, option: str) -> timedelta:
    """``30m``, ``2h``, ``7d``, ``2w``; a bare number is seconds; at most :data:`MAX_AGE`."""
    match = _AGE.fullmatch(value.strip().lower())
    if not match:
        raise CommandError(f"{option} {value!r}: give {AGE_HELP}")
    seconds = float(match[1]) * timedelta(**{_UNITS[match[2] or "s"]: 1}).total_seconds()  # inf past a float
    if not math.isfinite(seconds) or seconds > MAX_AGE.total_seconds():
        raise CommandError(f"{option} {value!r}: give an age of at most {MAX_AGE.days // 365} years")
    return timedelta(seconds=seconds)


def since(value: str, *, option: str, now: datetime | None = None) -> datetime:
    """An age before now (``2h``) or an ISO date/time (``2026-11-30``, ``2026-11-30T08:00``), in the project's
    time zone when it names none."""
    if _AGE.fullmatch(value.strip().lower()):
        return (now or timezone.now()) - age(value, option=option)
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise CommandError(f"{option} {value!r}: give an ISO date/time (2026-11-30T08:00) or {AGE_HELP}") from None
    if moment.year not in YEARS:
        raise CommandError(f"{option} {value!r}: give a date of the years {YEARS[0]} to {YEARS[-1]}")
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


def whole_number(value: str, *, option: str, minimum: int, maximum: int) -> int:
    """``value`` as a whole number from ``minimum`` to ``maximum`` (ASCII digits only)."""
    if not DIGITS.fullmatch(value.strip()) or not minimum <= int(value) <= maximum:
        raise CommandError(f"{option} {value[:40]!r}: give a whole number from {minimum:,} to {maximum:,}")
    return int(value)


def text(value: str, *, option: str, max_length: int | None = None, controls: bool = True) -> str:
    """``value`` if a column can hold it: no NUL; at most ``max_length`` characters; no control or invisible
    character at all with ``controls=False`` (a value the command writes, such as a name)."""
    if "\x00" in value:
        raise CommandError(f"{option} {value[:80]!r}: holds a NUL character, which no stored value holds")
    if not controls and escape(value) != value:
        raise CommandError(f"{option} {value[:80]!r}: holds a control or invisible character; give plain text")
    if max_length is not None and len(value) > max_length:
        raise CommandError(f"{option}: give at most {max_length} characters (got {len(value)})")
    return value


def choice(value: str, choices: Iterable[str], *, option: str) -> str:
    """``value`` if it is one of ``choices``; else an error that suggests the closest one."""
    known = list(choices)
    if value in known:
        return value
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(known)}"
    raise CommandError(f"{option} {value!r} is not known: {hint}")
