"""The test kit: a user's task on a real worker, put through the rubric's bad days.

A :class:`Kit` owns one :class:`~celery_guardrails.testing.worker.GuardedWorker` consuming a queue of its own,
the worker's event log, and (when the store is reachable over TCP) a proxy in front of the store. Its helpers
publish through the task's own ``apply_async`` (so every publish-time guardrail runs), keep the message exactly
as it went out, and then deliver it the way a bad day would: twice, to a worker killed half-way, over and over,
in the wrong order, across a deployment, or while the store is gone. Each helper waits until every delivery it
caused has ended for good (see :data:`~celery_guardrails.testing.events.TERMINAL`), restarting the worker when
it was killed, and returns a :class:`Report`.

The worker, its queues and the steps the helpers are made of are in :mod:`.harness`; what they take and
return, in :mod:`.reports`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from celery_guardrails.runtime import headers
from celery_guardrails.testing import events
from celery_guardrails.testing.harness import SETTLE_BOUND, KitHarness
from celery_guardrails.testing.reports import Captured, KitError, Release, Report, split_arguments

#: Times a poison message may kill its worker before ``poison`` calls it a loop (with no ``max_deliveries``
#: of the task's to go by).
POISON_BOUND = 10


class Kit(KitHarness):
    """The helpers of the test kit, on one worker (see the module docstring)."""

    # -- the bad days ------------------------------------------------------------------------------------

    def deliver_twice(self, task: Any, *args: Any, concurrently: bool = False, **kwargs: Any) -> Report:
        """The same message delivered twice: one after the other (a redelivery after an ack was lost), or
        both at once (``concurrently=True``).

        At once, the copies overlap by construction, not by luck: both are held at ``start`` until both are
        in, then let go; the first to reach ``body`` (every guardrail let it run: it holds its key) is held
        there until the other has ended an attempt (refused by the held key, or run its own body beside it)."""
        message = self.capture(task, *args, **kwargs)
        if concurrently:
            if self.worker.pool == "solo" or self.worker.concurrency < 2:
                raise KitError(
                    "deliver_twice(concurrently=True) needs a worker that runs two at once "
                    "(threads or prefork, concurrency >= 2)"
                )
            self._plan("pause", message.task_id, at="start", times=2)
            self._plan("pause", message.task_id, at="body", times=1)
            self.send(message)
            self.send(message)
            self._go(self.wait_until("both copies to start", lambda: self._paused(message.task_id, 2, at="start")))

            def first_in_body_and_other_ended() -> list[str]:
                held = self._paused(message.task_id, 1, at="body")
                found = self.messages().get(message.task_id, events.Message(""))
                return held if held and (found.outcomes or len(held) > 1) else []

            self._go(self.wait_until("the copies to meet", first_in_body_and_other_ended))
        else:
            self.send(message)
            self.settle([message.task_id])
            self.send(message)
        return self.report([message.task_id], self.settle([message.task_id]))

    def crash_mid_task(self, task: Any, *args: Any, at: str | float, **kwargs: Any) -> Report:
        """SIGKILL the worker while it runs the task, then let the message come back.

        ``at``: a point name (``"start"``, ``"body"``, ``"after_body"``, or one the body marks with
        :func:`celery_guardrails.fault_point`), or seconds after the delivery started."""
        message = self.capture(task, *args, **kwargs)
        kills = self.worker.kills
        if isinstance(at, str):
            self._plan("crash", message.task_id, at=at, times=1)
            self.send(message)

            def crashed_or_ended() -> str | None:
                found = self.messages().get(message.task_id)
                if self.worker.kills > kills or any(
                    e["e"] == "crash" and e.get("id") == message.task_id for e in self.event_log()
                ):
                    return "crashed"
                return "ended" if found is not None and found.settled else None

            if self.wait_until(f"the worker to crash at {at!r}", crashed_or_ended) == "ended":
                raise KitError(
                    f"{task.name}[{message.task_id}] ended without reaching the point {at!r}: nothing was crashed\n"
                    f"{self.describe()}"
                )
            self.wait_until("the crashed worker to be started again", lambda: self.worker.kills > kills)
            self._check_given_back(task, message)
        else:
            self.send(message)
            self.wait_until(
                "the delivery to start", lambda: self.messages().get(message.task_id, events.Message("")).starts
            )
            # How far into the body the crash comes: a fault's parameter, not a measure. A delivery that ends
            # sooner is told at once, not after the whole wait.
            due = time.monotonic() + float(at)
            while (left := due - time.monotonic()) > 0:
                if self.messages().get(message.task_id, events.Message("")).settled:
                    raise KitError(
                        f"{task.name}[{message.task_id}] ended within {at}s: nothing was crashed; crash it sooner"
                    )
                time.sleep(min(0.05, left))
            self.worker.kill()
            self.worker.start()
            self._check_given_back(task, message)
        found = self.settle([message.task_id])
        return self.report([message.task_id], found, crashes=self.worker.kills - kills)

    def _check_given_back(self, task: Any, message: Captured) -> None:
        """On Redis the kit sees what the dead worker held: a message it did not hold was acked before the
        crash (acks_late off), and nothing will ever finish what its body left half done."""
        found = self.messages().get(message.task_id, events.Message(""))
        if self.worker.redis_broker and message.task_id not in self.worker.returned and not found.settled:
            raise KitError(
                f"{task.name}[{message.task_id}] was lost in the crash: its worker had acked it before the body "
                f"ended (acks_late is off), so the broker will never deliver it again and what the body left "
                f"half done stays half done\n{self.describe()}"
            )

    def poison(
        self, task: Any, *args: Any, how: str = "crash", max_deliveries: int | None = None, **kwargs: Any
    ) -> Report:
        """A message that cannot be handled: it must end dead-lettered, never loop or vanish.

        ``how``: ``"crash"``, its body kills the worker every time it runs (the kit restarts the worker
        after each death, up to ``max_deliveries`` deaths, by default the task's ``max_deliveries`` plus 2);
        ``"malformed"``, its envelope is damaged (an ``eta`` no one can read)."""
        message = self.capture(task, *args, **kwargs)
        kills = self.worker.kills
        if how == "crash":
            bound = max_deliveries or _max_deliveries(task) + 2
            self._plan("crash", message.task_id, at="body", times=None)
            self.send(message)

            def ended() -> dict[str, events.Message] | None:
                if self.worker.kills - kills > bound:
                    raise KitError(
                        f"{task.name}[{message.task_id}] killed its worker {self.worker.kills - kills} times and was "
                        f"delivered again each time: it would loop for ever\n{self.describe()}"
                    )
                found = self.messages()
                return found if found.get(message.task_id, events.Message("")).settled else None

            found = self.wait_until(f"{task.name}[{message.task_id}] to end", ended)
            self._unplan("crash", message.task_id, at="body")
        elif how == "malformed":
            self.send(message, headers={"eta": "not a date"})
            found = self.settle([message.task_id])
        else:
            raise ValueError(f"how={how!r}: 'crash' or 'malformed'")
        return self.report([message.task_id], found, crashes=self.worker.kills - kills)

    def out_of_order(self, task: Any, messages: Sequence[Any], *, order: Sequence[int] | None = None) -> Report:
        """Publish ``messages`` in the order given (so an ordered task numbers them so), deliver them in
        ``order`` (positions; default: reversed), and wait until all have ended. ``Report.order`` gives the
        positions in the order their bodies succeeded."""
        captured = []
        for item in messages:
            args, kwargs = split_arguments(item)
            captured.append(self.capture(task, *args, **kwargs))
        sequence = list(order) if order is not None else list(range(len(captured)))[::-1]
        if sorted(sequence) != list(range(len(captured))):
            raise ValueError(f"order {sequence} is not an order of positions 0..{len(captured) - 1}")
        for position in sequence:
            self.send(captured[position])
        ids = [message.task_id for message in captured]
        return self.report(ids, self.settle(ids))

    def store_outage(self, task: Any, *args: Any, seconds: float = 1.0, at: str = "start", **kwargs: Any) -> Report:
        """Cut the store (Redis, or the Django database) while the task runs: the delivery is held at the
        point ``at`` until the store is cut, goes on without it, and the store comes back after the delivery
        ended its attempt (and at least ``seconds`` after the cut); then every delivery is waited for."""
        if self.proxy is None:
            raise KitError(f"store_outage cannot cut this store: {self.no_outage}")
        message = self.capture(task, *args, **kwargs)
        self._plan("pause", message.task_id, at=at, times=1)
        self.send(message)
        tokens = self.wait_until(f"the delivery to reach {at!r}", lambda: self._paused(message.task_id, 1, at=at))
        self.proxy.cut()
        cut_at = time.monotonic()
        try:
            self._go(tokens)
            self.wait_until(
                "the delivery to end its attempt without the store",
                lambda: self.messages().get(message.task_id, events.Message("")).outcomes or self.worker.kills,
            )
            time.sleep(max(0.0, seconds - (time.monotonic() - cut_at)))  # the outage's length: a fault's parameter
        finally:
            self.proxy.restore()
        return self.report([message.task_id], self.settle([message.task_id]))

    def deploy_during_processing(self, task: Any, *, old: Release, new: Release, replay: bool = True) -> Report:
        """A deployment while messages are in flight, old and new payload versions side by side.

        1. The worker runs ``old.app``; ``old.messages`` are published as old publishers do (``old.version``),
           and the first of them is held as it starts (delivered, running);
        2. new publishers start: ``new.messages`` go out (``new.version``) while the old worker still runs;
        3. the old worker gets a warm shutdown (SIGTERM) with that message still running, which is then let
           go: the shutdown waits for it, as a deployment's does;
        4. the worker starts again on ``new.app``, and runs what is left;
        5. with ``replay`` (Django), dead letters ``unknown_payload_version`` of these messages are replayed
           (the old worker's refusals), on the new worker.
        Returns when every message has ended for good."""
        original_app = self.worker.app
        captured_old = [self._versioned(task, item, old.version) for item in old.messages]
        captured_new = [self._versioned(task, item, new.version) for item in new.messages]
        if self.worker.pool == "solo" or self.worker.concurrency < 2:
            raise KitError("deploy_during_processing needs a worker that runs two at once (one message is held)")
        if old.app:
            self.worker.stop()
            self.worker.app = old.app
            self.worker.start()
        held = captured_old[0].task_id if captured_old else None
        if held:
            # Held as it starts, before the guardrails: a body held inside an atomic=True transaction would hold
            # SQLite's write lock, and every other delivery would wait on it.
            self._plan("pause", held, at="start", times=1)
        for message in captured_old:
            self.send(message)
        tokens = (
            self.wait_until("the first old message to start", lambda: self._paused(held, 1, at="start")) if held else []
        )
        for message in captured_new:
            self.send(message)
        # The old worker has had the new messages to refuse (or run wrongly) while it still ran.
        self.wait_until(
            "the old worker to take the new messages",
            lambda: all(self.messages().get(m.task_id, events.Message("")).outcomes for m in captured_new[:1]),
        )
        self.worker.terminate()  # the deployment begins: a warm shutdown, one message still in its body
        self._go(tokens)
        self.worker.stop()
        self.worker.app = new.app or original_app
        self.worker.start()
        ids = [m.task_id for m in captured_old + captured_new]
        found = self.settle(ids)
        replayed: dict[str, str] = {}
        if replay:
            replayed = self._replay_refused(ids)
            for task_id in replayed.values():
                self.sent[task_id] += 1
            found = self.settle([*ids, *replayed.values()])
        report = self.report([*ids, *replayed.values()], found)
        #: The refused messages replayed: task id -> the replay's task id.
        report.details["replayed"] = replayed
        report.details["old"] = [m.task_id for m in captured_old]
        report.details["new"] = [m.task_id for m in captured_new]
        return report

    def _versioned(self, task: Any, item: Any, version: int | None) -> Captured:
        args, kwargs = split_arguments(item)
        # The test process runs one release's code: a message of the other has a shape its signature may
        # refuse (Celery checks the arguments at publish, ``Task.typing``), as the other release's publishers
        # did not. Published as they would have, unchecked.
        typing = task.typing
        task.typing = False
        try:
            message = self.capture(task, *args, **kwargs)
        finally:
            task.typing = typing
        if version is not None:
            envelope = dict(message.headers.get(headers.HEADER) or {})
            envelope[headers.PAYLOAD_VERSION] = version
            message.headers[headers.HEADER] = envelope
        return message

    def _replay_refused(self, task_ids: list[str]) -> dict[str, str]:
        from celery_guardrails.runtime.dead_letters import sinks_for

        replays: dict[str, str] = {}
        for sink in sinks_for(self.celery_app):  # the Django sink replays; the Redis stream's are replayed by hand
            replays.update(sink.replay(task_ids, reason="unknown_payload_version", app=self.celery_app))
        return replays


def _max_deliveries(task: Any) -> int:
    from celery_guardrails.options import resolve

    try:
        return int(resolve(task, "max_deliveries", {}))
    except Exception:
        return POISON_BOUND - 2


__all__ = ["POISON_BOUND", "SETTLE_BOUND", "Captured", "Kit", "KitError", "Release", "Report"]
