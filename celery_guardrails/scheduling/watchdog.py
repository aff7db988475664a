"""Missed-run detection that does not depend on beat: compare each guarded schedule with the ledger.

One check (:func:`check`), for every watched beat entry (each has its policy, or the default one: see
:mod:`celery_guardrails.scheduling.beat`) whose schedule has a ledger record:

* each period due more than ``grace`` ago with no record (beat is down, or stuck) is recorded ``missed``;
* a record still ``dispatched`` more than ``grace`` after its period, or after its dispatch for a catch-up
  (no worker started it: the message is stuck in a queue or was lost) moves to ``missed``;
* a record ``running`` longer than ``max_runtime`` moves to ``overdue``;
* a disabled django-celery-beat row's newest due period is recorded ``skipped_disabled`` (see
  :func:`celery_guardrails.scheduling.beat.skip_disabled`), so its disabled time is never reported missed.

Each of these is one atomic insert or conditional update in the store, and only the check that made it
reports it: ``run_missed`` / ``run_overdue`` once per period, however many watchdogs and beats run (a period
already reported missed is not reported again; see :mod:`celery_guardrails.scheduling.ledger`), and an alert to the
entry's owner through ``alert_channels``, throttled per schedule by ``run_alert_throttle``. A schedule with
no record yet (beat never dispatched it) is not checked.

Where it runs:

* in every worker, as a bootstep thread (:class:`WatchdogStep`) that checks every ``watchdog_interval``
  seconds; a claim in the store with a lease of one interval lets one worker in the cluster check per
  interval (one claim per set of guarded schedules: see :func:`lock_key`). It also sends the dead-letter
  alert summaries that are due, reaps the concurrency slots of dead holders
  (:func:`celery_guardrails.guardrails.concurrency.reap`) and samples the queues for the activity about once a
  minute (:func:`celery_guardrails.operations.activity.sample_queues`). ``watchdog=False`` turns it off.
* as ``python manage.py guardrails_watchdog`` (Django), for cron or a Kubernetes CronJob.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from celery import bootsteps

from celery_guardrails.foundation.clock import now
from celery_guardrails.foundation.forks import quiet
from celery_guardrails.operations import activity
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.scheduling.beat import Entry, all_configured_entries, moment, report, skip_disabled
from celery_guardrails.scheduling.ledger import DISPATCHED, MISSED, OVERDUE, RUNNING, Heads
from celery_guardrails.stores import django_apps_installed, get_store
from celery_guardrails.stores.base import ACQUIRED

logger = logging.getLogger(__name__)

LOCK_KEY = "guardrails:watchdog"


#: The options the watchdog reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="watchdog",
        default=True,
        doc="Workers check the scheduled runs against the ledger (one worker at a time, see "
        "watchdog_interval); turn off when a cron job or Kubernetes CronJob runs guardrails_watchdog.",
        check=checks.boolean,
        scopes=frozenset({APP}),
    ),
    Option(
        name="watchdog_interval",
        default=30.0,
        doc="Seconds between two watchdog checks in the cluster (a run is reported missed at most "
        "grace plus this late).",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
)


@dataclass(slots=True)
class Findings:
    """What one check recorded: (schedule, period) pairs, newly missed and newly overdue."""

    missed: list[tuple[str, float]] = field(default_factory=list)
    overdue: list[tuple[str, float]] = field(default_factory=list)


def check(app: Any, *, entries: dict[str, Entry] | None = None, current: float | None = None) -> Findings:
    """Check every guarded schedule against the ledger once (see the module docstring). The ledger is read
    once for all of them (:meth:`~celery_guardrails.scheduling.ledger.RunLedger.run_heads`): a few queries for 10,000
    schedules on the Django store, not two each."""
    entries, disabled = all_configured_entries(app) if entries is None else (entries, {})
    current = now(app) if current is None else current
    findings = Findings()
    store = get_store(app)
    try:
        heads = store.run_heads([*disabled, *entries])
    except Exception:  # a store outage: nothing can be checked now; the next check will
        logger.exception("Watchdog: reading the ledger of %d schedule(s) failed", len(disabled) + len(entries))
        return findings
    for entry in disabled.values():  # their due periods are skipped, not missed (beat may be down)
        try:
            skip_disabled(app, entry, current, heads=heads[entry.name])
        except Exception:
            logger.exception("Watchdog: recording the disabled %r skipped failed", entry.name)
    for entry in entries.values():
        try:
            _check_entry(app, store, entry, current, findings, heads[entry.name])
        except Exception:  # one schedule (or a store hiccup) must not hide the others
            logger.exception("Watchdog: checking %r failed", entry.name)
    return findings


def _check_entry(app: Any, store: Any, entry: Entry, current: float, findings: Findings, heads: Heads) -> None:
    grace = entry.grace
    if heads.newest_period is None:
        return
    for period in entry.periods(heads.newest_period, current - grace - 1e-6):  # late: more than grace
        reason = f"not dispatched within {grace:g}s of its due time (is beat running?)"
        if store.run_record(entry.name, period, status=MISSED, now=current, reason=reason):
            findings.missed.append((entry.name, period))
            report(app, entry, period, kind="missed", reason=reason)
    for run in heads.pending:
        # Late from its dispatch, not its due time: a catch-up dispatched after its period's grace is not
        # lost the moment it is sent (seen as a second missed alert when the worker was slower than a check).
        sent = max(run.period, run.dispatched_at or run.period)
        if run.status == DISPATCHED and current - sent > grace:
            reason = f"dispatched as {run.task_id} but not started within {grace:g}s (queue backlog or lost message)"
            if store.run_transition(entry.name, run.period, from_=(DISPATCHED,), to=MISSED, now=current, reason=reason):
                findings.missed.append((entry.name, run.period))
                report(app, entry, run.period, kind="missed", reason=reason, task_id=run.task_id)
        limit = entry.policy.max_runtime
        if run.status == RUNNING and limit is not None and run.started_at and current - run.started_at > limit:
            reason = f"running for {current - run.started_at:.0f}s, past max_runtime {limit:g}s"
            if store.run_transition(entry.name, run.period, from_=(RUNNING,), to=OVERDUE, now=current, reason=reason):
                findings.overdue.append((entry.name, run.period))
                report(
                    app,
                    entry,
                    run.period,
                    kind="overdue",
                    reason=reason,
                    task_id=run.task_id,
                    started_at=moment(run.started_at),
                )


def lock_key(app: Any) -> str:
    """The watchdog claim of the app's schedules (named by the sorted names of its policies and settings entries:
    known without a database read).

    The workers of one app share it. Another app on the same store, watching other schedules, has its own:
    with one claim for all, the app that checked first in each interval could keep the others from ever
    checking theirs.
    """
    names = "\n".join(sorted({*app_value(app, "schedules"), *(app.conf.beat_schedule or {})}))
    return f"{LOCK_KEY}:{hashlib.sha256(names.encode()).hexdigest()[:16]}"


def watches_anything(app: Any) -> bool:
    """Whether the app may have a watched schedule (every beat entry is watched, policy or not): without one, the
    watchdog takes no claim in the store."""
    return bool(app_value(app, "schedules") or app.conf.beat_schedule or django_apps_installed("django_celery_beat"))


def check_if_my_turn(app: Any, *, owner: str) -> Findings | None:
    """Check unless another process checked within the last ``watchdog_interval``; None when it did."""
    interval = app_value(app, "watchdog_interval")
    claim = get_store(app).claim(lock_key(app), owner=owner, now=time.time(), lease=interval * 0.9, retention=interval)
    if claim.state != ACQUIRED:
        return None
    return check(app)


def _consumed(app: Any) -> list[str]:
    """The queues this worker consumes from (``-Q``), sampled with the app's declared ones."""
    try:
        queues = app.amqp.queues
        return sorted(queues.consume_from or queues)
    except Exception:  # an app without its queues set up: the declared ones only
        logger.debug("Watchdog: the consumed queues could not be read", exc_info=True)
        return []


class WatchdogStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: a daemon thread that runs the watchdog (and due alert summaries) every interval."""

    label = "Guardrails watchdog"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.queues: list[str] = []
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        app = parent.app
        if not app_value(app, "watchdog"):
            return
        owner = f"{getattr(parent, 'hostname', None) or socket.gethostname()}:{os.getpid()}"
        self.queues = _consumed(app)
        self.thread = threading.Thread(target=self._loop, args=(app, owner), name="guardrails-watchdog", daemon=True)
        self.thread.start()

    def _loop(self, app: Any, owner: str) -> None:
        interval = app_value(app, "watchdog_interval")
        while not self.stopping.wait(interval):
            with quiet():  # no pool child forked while a tick is inside the database driver
                self.tick(app, owner)

    def tick(self, app: Any, owner: str) -> None:
        from celery_guardrails.guardrails.concurrency import reap
        from celery_guardrails.operations.alerts import flush_alert_summaries

        try:
            flush_alert_summaries(app)
            if watches_anything(app):
                check_if_my_turn(app, owner=owner)
        except Exception:  # the watchdog must never take the worker down
            logger.exception("Watchdog check failed")
        try:
            reap(app)  # concurrency slots whose holder died: the reaper on a timer (every worker, every interval)
        except Exception:
            logger.exception("Watchdog: reaping concurrency slots failed")
        try:
            if activity.enabled(app):
                activity.sample_queues(app, owner=owner, names=self.queues)
        except Exception:
            logger.exception("Watchdog: sampling the queues for the activity failed")
        finally:
            close = getattr(get_store(app), "close_thread", None)
            if close is not None:
                close()  # Django store: no connection held open between checks

    def stop(self, parent: Any) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)  # a check under way finishes; the next one never starts

    # A warm shutdown stops the steps, a cold one terminates them (so does an embedded test worker).
    terminate = stop
