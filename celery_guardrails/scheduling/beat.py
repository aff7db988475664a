"""Scheduled work with stated guardrails: every beat entry dispatches through the run ledger.

Run beat with a guarded scheduler::

    celery -A proj beat -S celery_guardrails.scheduling.beat:GuardedScheduler
    celery -A proj beat -S django_celery_guardrails.schedulers:GuardedDatabaseScheduler

Every entry of ``CELERY_BEAT_SCHEDULE`` and every django-celery-beat ``PeriodicTask`` is *watched*: the entry's
policy in ``CELERY_GUARDRAILS["schedules"]`` (see :class:`~.policy.SchedulePolicy`), else the
default policy (:data:`~.policy.DEFAULT_POLICY`: grace 60 s, or half the entry's period when
that is shorter). These are left to Celery as they are (:func:`watched_by_default` says why):

* an entry whose policy is ``None`` (``schedules = {"cleanup": None}``: opted out);
* with no policy written: an entry whose task is a plain Celery task registered in this process (only a
  ``GuardedTask`` records its runs in the ledger; Celery's own ``celery.backend_cleanup`` and the guardrails
  app's ``django_celery_guardrails.prune`` are plain tasks, never watched by default), a one-off
  django-celery-beat row, and a schedule the guardrails cannot read (solar, clocked, an interval shorter
  than a second or not whole seconds, a row that does not parse: a written policy makes those an error).

For watched entries the scheduler does not use Celery's own "is it due" arithmetic. On every tick (at most a
second apart) it reads each entry's timetable (:mod:`celery_guardrails.scheduling.schedules`: its time zone and DST
rules) from the entry's *horizon*, the newest period the ledger says was handled, to now:

* a period due within ``grace`` is dispatched: its ledger record is inserted first (unique per schedule and
  period, so a second beat process dispatching the same period gets ``False`` and publishes nothing), then
  the message is published with the period in its ``guardrails`` header and the period key as its
  idempotency key (a manual re-run of that period is a duplicate, skipped by the worker);
* periods older than ``grace`` (beat was down) are handled by ``catch_up``: ``skip`` records them missed,
  ``latest`` dispatches the newest one (when a period is due on time in the same tick, it is the newest: the
  late ones are recorded missed and the current one runs, never skipped as overlapping a stale run), ``all``
  dispatches each, oldest first (the newest ``catch_up_limit``; older ones are recorded missed). A catch-up
  message says so in its header (``catchup``): on the worker, a current run never yields to a catch-up run
  under ``overlap="skip"`` (it waits for it; see :mod:`celery_guardrails.guardrails.scheduled_runs`). At most
  :data:`LOOKBACK` seconds are looked back at.

The horizon is read from the ledger when beat starts, so a restart neither repeats nor forgets a period
(django-celery-beat #634 is the bug this avoids). A disabled django-celery-beat row is not dispatched: each of
its periods that comes due is recorded ``skipped_disabled`` (by beat, or by the watchdog when beat is down),
so that enabled again it goes on from its next period instead of owing (and alerting) its disabled time.
An entry may also give its schedule as a 5-field crontab string (``"30 2 * * *"``).

This module is the scheduler; the entries are read in :mod:`.entries` and their due periods handled in
:mod:`.runs`. Their names stay importable from here, where other modules and settings name them.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

from celery.beat import PersistentScheduler

from celery_guardrails.exceptions import ConfigurationError

# accelerated_clock stays importable from here: settings name it as celery_guardrails.scheduling.beat.accelerated_clock.
from celery_guardrails.foundation.clock import accelerated_clock, now
from celery_guardrails.log import moment_text
from celery_guardrails.scheduling.entries import (
    Entry,
    NotWatched,
    Watch,
    all_configured_entries,
    build_disabled_entries,
    build_entries,
    check_tasks,
    configured_entries,
    own_zone,
    read_entry,
    states_no_timezone,
    watch_list,
)
from celery_guardrails.scheduling.ledger import MISSED
from celery_guardrails.scheduling.runs import (
    PublishFailed,
    dispatch,
    horizon,
    moment,
    owner_of_entry,
    plan,
    report,
    skip_disabled,
)
from celery_guardrails.scheduling.schedules import parse_crontab
from celery_guardrails.stores import get_store

logger = logging.getLogger(__name__)

#: Seconds a guarded scheduler sleeps at most between two looks at its entries.
TICK = 1.0


class GuardedSchedulerMixin:
    """Beat scheduler behaviour for entries with a policy (mixed into a Celery scheduler class)."""

    app: Any
    schedule: Any
    _heap: Any
    _guardrails_horizons: dict[str, float]
    _guardrails_warned: set[str]
    _guardrails_entries: dict[str, Entry]

    def setup_schedule(self) -> None:
        self._guardrails_horizons = {}
        self._guardrails_skipped: dict[str, float] = {}  # disabled entry -> when its next period comes due
        self._guardrails_warned = set()
        # Crontab strings become Celery crontabs before Celery reads the entries (it cannot read strings).
        for name, item in (self.app.conf.beat_schedule or {}).items():
            if isinstance(item, dict) and isinstance(item.get("schedule"), str):
                try:
                    item["schedule"] = parse_crontab(item["schedule"])
                except ValueError as exc:
                    raise ConfigurationError("beat_schedule", f"entry {name!r}: {exc}") from None
        super().setup_schedule()  # type: ignore[misc]
        entries = self._guardrails_entries = self.guarded_entries()  # a bad policy stops beat, naming the entry
        check_tasks(self.app, entries)
        described = [f"{name} ({'default' if e.default else 'its'} policy)" for name, e in sorted(entries.items())]
        logger.info("celery-guardrails: watched beat entries: %s", ", ".join(described) or "none")
        unwatched = sorted(set(self.known_entry_names()) - set(entries))
        if unwatched:
            logger.info("celery-guardrails: beat entries left to Celery (not watched): %s", ", ".join(unwatched))

    def known_entry_names(self) -> set[str]:
        return set(self.schedule)

    def guarded_entries(self) -> dict[str, Entry]:
        return build_entries(self.app, self.schedule, known=self.known_entry_names(), warned=self._guardrails_warned)

    def current_entries(self) -> dict[str, Entry]:
        """The guarded entries for this tick: the ones read at start-up (a scheduler whose entries can change
        while it runs re-reads them here)."""
        return self._guardrails_entries

    def current_disabled_entries(self) -> dict[str, Entry]:
        """The guarded entries that are disabled now (a scheduler whose entries can be disabled says which)."""
        return {}

    def dispatched(self, entry: Entry, period: float, task_id: str) -> None:
        """Called after this scheduler dispatched a period (a hook for the scheduler's own bookkeeping)."""

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        super().populate_heap(*args, **kwargs)  # type: ignore[misc]
        # Watched entries are dispatched by tick_guarded, never by Celery's heap.
        watched = {*getattr(self, "_guardrails_entries", {}), *self.current_disabled_entries()}
        self._heap = [event for event in self._heap if event[2].name not in watched]
        heapq.heapify(self._heap)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        wait = self.tick_guarded()
        return float(min(wait, super().tick(*args, **kwargs)))  # type: ignore[misc]

    def tick_guarded(self) -> float:
        """Dispatch or record every due period of the guarded entries; seconds until the next look."""
        current = now(self.app)
        wait = TICK
        entries = self.current_entries()
        # An entry gone from the schedule (disabled, deleted) is read from the ledger again if it comes back:
        # its horizon moved on meanwhile (skipped_disabled records), and a cached one would owe every period.
        for name in set(self._guardrails_horizons) - set(entries):
            del self._guardrails_horizons[name]
        for entry in entries.values():
            try:
                wait = min(wait, self._tick_entry(entry, current))
            except Exception:  # one broken entry (or a store outage) must not stop the others
                logger.exception("Guarded beat entry %r: tick failed", entry.name)
        skipped = self._guardrails_skipped
        for entry in self.current_disabled_entries().values():
            if skipped.get(entry.name, 0.0) > current:
                continue  # its newest due period is recorded; nothing new is due before this
            try:
                horizon = skip_disabled(self.app, entry, current)
                skipped[entry.name] = entry.next_due(max(horizon or current, current))
            except Exception:
                logger.exception("Guarded beat entry %r (disabled): tick failed", entry.name)
        return max(wait, 0.05)

    def _tick_entry(self, entry: Entry, current: float) -> float:
        seen = self._guardrails_horizons.get(entry.name)
        if seen is None:
            found = horizon(self.app, entry.name)
            seen = current if found is None else found  # never run: start now, nothing to catch up
            logger.info(
                "Guarded beat entry %r: periods after %s are due (%s)",
                entry.name,
                moment_text(seen),
                "no ledger record yet: from now on" if found is None else "the ledger's newest handled period",
            )
        periods = entry.periods(seen, current)
        if periods:
            to_dispatch, to_record = plan(entry, periods, current)
            store = get_store(self.app)
            for period in to_record:
                reason = f"beat did not dispatch it within {entry.grace:g}s (catch_up={entry.policy.catch_up})"
                if store.run_record(entry.name, period, status=MISSED, now=current, reason=reason):
                    report(self.app, entry, period, kind="missed", reason=reason)
            for period in to_dispatch:
                try:
                    task_id = dispatch(
                        self.app, entry, period, current=current, catch_up=current - period > entry.grace
                    )
                except PublishFailed:  # not published: the next tick looks at this period again
                    self._guardrails_horizons[entry.name] = period - 1
                    raise
                if task_id is not None:
                    try:
                        self.dispatched(entry, period, task_id)
                    except Exception:  # the scheduler's own bookkeeping; the period is dispatched
                        logger.exception("Guarded beat entry %r: bookkeeping of %s failed", entry.name, task_id)
            seen = periods[-1]
        self._guardrails_horizons[entry.name] = seen
        return entry.next_due(max(seen, current)) - current


class GuardedScheduler(GuardedSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default (shelve-file) scheduler with the schedule guardrails."""


__all__ = [
    "Entry",
    "GuardedScheduler",
    "GuardedSchedulerMixin",
    "NotWatched",
    "PublishFailed",
    "Watch",
    "accelerated_clock",
    "all_configured_entries",
    "build_disabled_entries",
    "build_entries",
    "check_tasks",
    "configured_entries",
    "dispatch",
    "horizon",
    "moment",
    "now",
    "own_zone",
    "owner_of_entry",
    "plan",
    "read_entry",
    "report",
    "skip_disabled",
    "states_no_timezone",
    "watch_list",
]
