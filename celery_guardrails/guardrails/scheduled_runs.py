"""Scheduled runs on the worker: the ledger record, the overlap policy and the horizon of one period.

A message a guarded beat dispatched carries its schedule and period in the ``guardrails`` header (see
:mod:`celery_guardrails.scheduling.beat`) and the period key as its idempotency key, so the idempotency guardrail has
already skipped a period that ran before. Then, for the entry's policy:

* overlap: ``skip`` and ``queue`` take the schedule's *run slot*, a claim in the store renewed by the same
  heartbeat as idempotency keys (so a run whose worker died frees it when its lease runs out). Held by
  another run, ``skip`` records the period ``skipped_overlap`` and returns without running the body;
  ``queue`` comes back later through ``RetryLater``. ``allow`` takes no slot. A period dispatched on time never
  yields to a catch-up (a period beat dispatched late, header ``catchup``): held by a catch-up run, ``skip``
  waits for it as ``queue`` does, so a stale run never makes the current one ``skipped_overlap``. A catch-up
  finding the slot held is skipped as any run is.
* the ledger record goes to ``running``, then ``ok`` or ``failed``;
* ``since=True``: ``self.request.since`` is the end of the last successful period, read from the ledger
  (None before the first success), and is passed as ``since=`` when the task takes that argument.

The task sees ``self.request.schedule_name``, ``self.request.period`` (the due instant, an aware UTC
datetime) and ``self.request.period_key``.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from celery_guardrails.exceptions import RetryLater
from celery_guardrails.foundation.clock import now
from celery_guardrails.foundation.redaction import redacted_error
from celery_guardrails.guardrails.keys import task_signature
from celery_guardrails.guardrails.retries import retry_later
from celery_guardrails.options import app_value
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import Hold, RunSlot, ScheduledPeriod, delivery, view
from celery_guardrails.runtime.heartbeats import delivery_owner, heartbeat
from celery_guardrails.runtime.pipeline import Guardrail, Publication, SkipBody
from celery_guardrails.scheduling.beat import moment
from celery_guardrails.scheduling.ledger import FAILED, OK, SKIPPED_OVERLAP, period_key
from celery_guardrails.scheduling.policy import DEFAULT_POLICY, SchedulePolicy
from celery_guardrails.stores import get_store
from celery_guardrails.stores.base import ACQUIRED

if TYPE_CHECKING:
    from celery_guardrails.runtime.pipeline import Task as GuardedTask

logger = logging.getLogger(__name__)

#: A period of an entry opted out after dispatch (``schedules = {name: None}``) is still recorded, and may overlap.
NO_POLICY = SchedulePolicy(overlap="allow")
#: What a slot owner ends with when its run is a catch-up (a current run finding it so waits instead of skipping).
CATCH_UP_OWNER = "+catch-up"


def slot_key(schedule: str) -> str:
    return f"guardrails:schedule-slot:{schedule}"


class ScheduledRuns(Guardrail):
    """Ledger, overlap and horizon of a scheduled period."""

    def on_publish(self, task: GuardedTask, publication: Publication) -> None:
        header = publication.header
        period = header.get(headers.PERIOD)
        if isinstance(header.get(headers.SCHEDULE), str) and isinstance(period, int):
            # The period key is the idempotency key of scheduled work, whatever key the task makes itself.
            header[headers.IDEMPOTENCY_KEY] = period_key(header[headers.SCHEDULE], period)

    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = task.request
        header = view(task).header
        name, period = header.get(headers.SCHEDULE), header.get(headers.PERIOD)
        if name is None or period is None:
            return
        # An entry the setting does not name runs with the default policy, as beat dispatched it.
        policy = app_value(task.app, "schedules").get(name, DEFAULT_POLICY) or NO_POLICY
        catch_up = header.get(headers.CATCH_UP) == 1
        request.schedule_name, request.period = name, moment(period)
        request.period_key = period_key(name, period)
        store = get_store(task.app)
        state = delivery(task)
        if policy.overlap != "allow":
            owner = delivery_owner(request) + (CATCH_UP_OWNER if catch_up else "")
            lease = view(task).options["idempotency_lease"]
            # Leases are real time (the heartbeat renews them with time.time()), whatever the clock option.
            claim = store.claim(slot_key(name), owner=owner, now=time.time(), lease=lease, retention=lease)
            if claim.state != ACQUIRED:
                if not catch_up and claim.owner.endswith(CATCH_UP_OWNER):
                    why = "a catch-up run is still going (the current period waits for it)"
                elif headers.REPLAY_OF in header:
                    # A replay is a run someone asked for: it waits its turn, never skipped as an overlap (its
                    # record would read replayed, its period skipped, and nothing would have run).
                    why = "a replay waits for it"
                else:
                    why = None
                self._overlapping(task, name, period, policy, claim.lease_until, waits=why)
            state.slot = RunSlot(key=slot_key(name), owner=owner, lease=lease)
            state.holds.append(Hold(owner, lambda: store.release(slot_key(name), owner=owner)))
        store.run_start(name, period, task_id=request.id, now=now(task.app))
        state.period = ScheduledPeriod(schedule=name, period=period)
        if policy.since:
            last = store.run_list(name, statuses=(OK,), before=period, limit=1)
            request.since = moment(last[0].period) if last else None
            if "since" in task_signature(task).parameters:
                kwargs["since"] = request.since

    def _overlapping(
        self, task: GuardedTask, name: str, period: int, policy: SchedulePolicy, until: float, *, waits: str | None
    ) -> None:
        """The slot is another run's: skip this period (overlap=skip) or put it off; ``waits`` says why it is put
        off whatever the policy (behind a catch-up, a replay), None: as the policy says."""
        if policy.overlap == "skip" and waits is None:
            reason = "the previous run was still going (overlap=skip)"
            logger.warning("Scheduled run %s of %r skipped: %s", moment(period), name, reason)
            get_store(task.app).run_finish(name, period, status=SKIPPED_OVERLAP, now=now(task.app), reason=reason)
            raise SkipBody(None)  # a success: the period key is completed, a re-dispatch is a duplicate
        why = waits or "overlap=queue"
        wait = RetryLater(f"scheduled run {name!r}: the previous run is still going ({why})")
        delay = max(0.5, min(until - time.time() + 0.5, view(task).options["retry_later_delay"]))
        # A wait behind a live run slot, like one behind a held key: bounded by that run's lease, not by
        # retry_later_max.
        retry_later(task, wait, delay=delay, rule="schedule:overlap", counter=headers.BUSY)

    def body_context(self, task: GuardedTask) -> AbstractContextManager[Any] | None:
        state = delivery(task)
        slot = state.slot
        if slot is None or state.period is None:
            return None
        return heartbeat(get_store(task.app), slot.key, slot.owner, lease=slot.lease)

    def _finish(self, task: GuardedTask, status: str, reason: str = "") -> None:
        state = delivery(task)
        period, slot = state.period, state.slot
        if period is None:
            return
        store = get_store(task.app)
        try:
            store.run_finish(period.schedule, period.period, status=status, now=now(task.app), reason=reason)
        finally:  # the slot is freed whatever became of the ledger record (else it lapses with its lease)
            if slot is not None:
                state.slot = None
                state.forget(slot.owner)
                store.release(slot.key, owner=slot.owner)

    def on_success(self, task: GuardedTask, retval: Any) -> None:
        self._finish(task, OK)

    def on_failure(self, task: GuardedTask, exc: BaseException, einfo: Any) -> None:
        self._finish(task, FAILED, redacted_error(task, exc))  # kept in the run ledger: redacted
