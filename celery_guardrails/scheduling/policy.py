"""The schedule policy: the guardrails of one beat entry (timezone, overlap, catch-up, grace, run time, DST,
owner, tenant), parsed from the ``schedules`` setting and checked key by key with a "did you mean".

The beat scheduler (:mod:`~celery_guardrails.scheduling.beat`), the watchdog and the ScheduledRuns guardrail read
an entry's policy with ``app_value(app, "schedules").get(entry, DEFAULT_POLICY)``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery_guardrails.foundation.context import validate_tenant
from celery_guardrails.options import APP, Option, checks, declare


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulePolicy:
    """The guardrails of one beat entry (``schedules["<entry name>"]``); defaults documented here.

    An entry with no policy is watched with these defaults (:data:`DEFAULT_POLICY`: ``default`` True); a policy of
    ``None`` (``schedules = {"cleanup": None}``) opts the entry out, leaving it to Celery as it is.
    """

    #: IANA zone the entry's crontab is read in; None: the crontab's own zone, else the app's ``timezone``
    #: (a crontab entry without one gets a start-up warning that names it).
    timezone: ZoneInfo | None = None
    #: A period due while the previous run still goes: "skip" it (recorded skipped_overlap), "queue" it
    #: (it waits, through RetryLater), or "allow" both to run.
    overlap: str = "skip"
    #: Periods beat missed (down longer than grace): "skip" (record them missed, run none), "latest" (run
    #: the most recent once, as Celery beat does), or "all" (run each, oldest first, the newest
    #: catch_up_limit of them).
    catch_up: str = "latest"
    catch_up_limit: int = 10
    #: Seconds a run may start late before its period counts as missed; None (not set): 60 s, or half the
    #: entry's period when that is shorter (an every-4-s entry is missed 2 s late): see :meth:`grace_for`.
    grace: float | None = None
    #: Seconds a started run may take before it counts as overdue (None: never).
    max_runtime: float | None = None
    #: Give the task the end of the last successful period (``self.request.since``, and ``since=`` when
    #: the task takes that argument).
    since: bool = False
    #: A fixed local time that happens twice (fall back) runs at the "first" occurrence, or at "both".
    fall_back: str = "first"
    #: Who hears of missed and overdue runs (else the task's owner).
    owner: str | None = None
    #: The tenant every run of the entry runs as, unless the entry names its own (a beat_schedule entry's
    #: ``options={"tenant": ...}``, a django-celery-beat row's headers ``{"tenant": ...}``).
    tenant: str | None = None
    #: True for the policy of an entry the ``schedules`` setting does not name (shown as "default").
    default: bool = False

    def grace_for(self, period: float | None) -> float:
        """The grace in seconds of an entry whose period (seconds between runs; None: not known) is ``period``:
        the policy's own, else :data:`DEFAULT_GRACE` capped at half the period."""
        if self.grace is not None:
            return self.grace
        return DEFAULT_GRACE if period is None else min(DEFAULT_GRACE, period / 2)


#: Seconds of grace of a policy that sets none, at most (half the entry's period when that is shorter).
DEFAULT_GRACE = 60.0


#: The policy of a beat entry the ``schedules`` setting does not name: watched, with every default.
DEFAULT_POLICY = SchedulePolicy(default=True)


def _zone(value: Any) -> ZoneInfo | None:
    if value is None:
        return None
    try:
        return ZoneInfo(str(value))
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r:.80} (an IANA name such as 'Europe/Berlin')") from None


POLICY_CHECKS: Mapping[str, Callable[[Any], Any]] = {
    "timezone": _zone,
    "overlap": checks.choice("skip", "queue", "allow"),
    "catch_up": checks.choice("skip", "latest", "all"),
    "catch_up_limit": checks.positive_int,
    "grace": checks.seconds,
    "max_runtime": checks.optional(checks.seconds),
    "since": checks.boolean,
    "fall_back": checks.choice("first", "both"),
    "owner": checks.name,
    "tenant": checks.optional(validate_tenant),
}


def parse_schedules(value: Any) -> dict[str, SchedulePolicy | None]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map beat entry names to policy dicts (or None to opt out), got {value!r:.80}")
    policies: dict[str, SchedulePolicy | None] = {}
    for entry, raw in value.items():
        if not isinstance(entry, str) or not entry or len(entry) > 200:
            raise ValueError(f"entry names are strings of 1 to 200 characters, got {entry!r:.80}")
        if raw is None:  # opted out: not watched, left to Celery as it is
            policies[entry] = None
            continue
        if not isinstance(raw, Mapping):
            raise ValueError(f"entry {entry!r}: the policy must be a dict (or None to opt out), got {raw!r:.80}")
        checked = {}
        for key, item in raw.items():
            if key not in POLICY_CHECKS:
                close = difflib.get_close_matches(str(key), list(POLICY_CHECKS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(POLICY_CHECKS)}"
                raise ValueError(f"entry {entry!r}: unknown policy key {key!r}{hint}")
            try:
                checked[key] = POLICY_CHECKS[key](item)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"entry {entry!r}, {key}: {exc}") from None
        policies[entry] = SchedulePolicy(**checked)
    return policies


#: The option that holds the policies, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="schedules",
        default={},
        doc="Policies of beat entries (CELERY_BEAT_SCHEDULE names or django-celery-beat PeriodicTask "
        "names): {'nightly-report': {'timezone': 'Europe/Berlin', 'overlap': 'skip', 'catch_up': "
        "'latest', 'grace': 300, 'max_runtime': 3600}}. See SchedulePolicy for every key. An entry it does "
        "not name is watched with the default policy (grace: 60 s or half its period); None opts one out "
        "({'cleanup': None}).",
        check=parse_schedules,
        scopes=frozenset({APP}),
    ),
)
