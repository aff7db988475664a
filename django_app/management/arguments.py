"""What the management commands accept, checked in one place: ages, moments and choices.

Each check raises :class:`~django.core.management.base.CommandError` with one line naming the option and
what it takes; Django prints it as ``CommandError: ...`` and exits 1, never with a traceback. Commands take
their values as text and check them in ``handle`` (an error raised while argparse converts a value would end
in a traceback: Django catches CommandError around ``handle`` only).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.core.management.base import CommandError
from django.utils import timezone

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
AGE_HELP = "an age such as 90s, 30m, 2h, 7d or 2w (a bare number is seconds)"


def age(value: str, *, option: str) -> timedelta:
    """``30m``, ``2h``, ``7d``, ``2w``; a bare number is seconds."""
    match = _AGE.fullmatch(value.strip().lower())
    if not match:
        raise CommandError(f"{option} {value!r}: give {AGE_HELP}")
    amount = float(match[1])
    return timedelta(**{_UNITS[match[2] or "s"]: amount})


def since(value: str, *, option: str, now: datetime | None = None) -> datetime:
    """An age before now (``2h``) or an ISO date/time (``2026-11-30``, ``2026-11-30T08:00``), in the project's
    time zone when it names none."""
    if _AGE.fullmatch(value.strip().lower()):
        return (now or timezone.now()) - age(value, option=option)
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise CommandError(f"{option} {value!r}: give an ISO date/time (2026-11-30T08:00) or {AGE_HELP}") from None
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


def choice(value: str, choices: Iterable[str], *, option: str) -> str:
    """``value`` if it is one of ``choices``; else an error that suggests the closest one."""
    known = list(choices)
    if value in known:
        return value
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(known)}"
    raise CommandError(f"{option} {value!r} is not known: {hint}")
