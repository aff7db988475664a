"""The test kit: a user's task on a real worker, put through the rubric's bad days.

A :class:`Kit` owns one :class:`~celery_guardrails.testing.worker.GuardedWorker` consuming a queue of its own,
the worker's event log, and (when the store is reachable over TCP) a proxy in front of the store. Its helpers
publish through the task's own ``apply_async`` (so every publish-time guardrail runs), keep the message exactly
as it went out, and then deliver it the way a bad day would: twice, to a worker killed half-way, over and over,
in the wrong order, across a deployment, or while the store is gone. Each helper waits until every delivery it
caused has ended for good (see :data:`~celery_guardrails.testing.events.TERMINAL`), restarting the worker when
it was killed, and returns a :class:`Report`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery.signals import before_task_publish

from celery_guardrails.runtime import headers
from celery_guardrails.testing import events
from celery_guardrails.testing.proxy import TcpProxy
from celery_guardrails.testing.worker import GuardedWorker

#: Seconds a helper waits for the deliveries it caused to end before it fails (a machine that has stopped,
#: not a measure of speed).
SETTLE_BOUND = 120.0
#: Times a poison message may kill its worker before ``poison`` calls it a loop (with no ``max_deliveries``
#: of the task's to go by).
POISON_BOUND = 10


class KitError(AssertionError):
    """A helper could not do what it was asked, or saw the handler fail the test: the message says which,
    with what the worker did."""


@dataclass
class Captured:
    """A message as the task's ``apply_async`` published it: sent again as is, it is the same message."""

    task_id: str
    task_name: str
    body: Any
    headers: dict[str, Any]
    properties: dict[str, Any]


@dataclass
class Report:
    """What the worker did with the messages of one helper call."""

    task_ids: list[str]
    messages: dict[str, events.Message]
    #: Times the worker was killed during the call (by the plan or by the kit).
    crashes: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return self.task_ids[0]

    def of(self, task_id: str | None = None) -> events.Message:
        found = task_id or self.task_id
        return self.messages.get(found) or events.Message(found)

    @property
    def deliveries(self) -> int:
        """Deliveries started, over all the call's messages."""
        return sum(self.of(task_id).starts for task_id in self.task_ids)

    @property
    def outcomes(self) -> list[tuple[str, str]]:
        """How each delivery ended (outcome, detail), over all the call's messages, in order."""
        return [outcome for task_id in self.task_ids for outcome in self.of(task_id).outcomes]

    @property
    def order(self) -> list[int]:
        """The positions (in the order given) of the messages, in the order their bodies succeeded."""
        position = {task_id: index for index, task_id in enumerate(self.task_ids)}
        return [position[task_id] for task_id in self.details.get("succeeded_order", []) if task_id in position]


@dataclass
class Release:
    """One side of a deployment: what its publishers send, and the code its workers run.

    ``messages``: each an argument tuple, a keyword dict, or an ``(args, kwargs)`` pair. ``version``: the
    payload version its publishers stamp (the header field ``pv``; None: the task's own ``payload_version``).
    ``app``: the Celery app its workers run, as ``celery -A`` takes it (None: the kit's)."""

    messages: Sequence[Any]
    version: int | None = None
    app: str | None = None


def _split(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(item, dict):
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple | list) and isinstance(item[1], dict):
        return tuple(item[0]), dict(item[1])
    if isinstance(item, tuple | list):
        return tuple(item), {}
    return (item,), {}


class Kit:
    """The helpers of the test kit, on one worker (see the module docstring)."""

    def __init__(
        self,
        *,
        celery_app: Any,
        app_path: str,
        folder: Path,
        pool: str = "prefork",
        concurrency: int = 2,
        databases: dict[str, dict[str, Any]] | None = None,
        settle_bound: float = SETTLE_BOUND,
    ) -> None:
        self.celery_app = celery_app
        self.folder = folder
        self.settle_bound = settle_bound
        token = uuid.uuid4().hex[:10]
        self.queue = f"guardrails-kit-{token}"
        #: Where captured messages go when they are first published (no worker consumes it).
        self.hold = f"guardrails-kit-{token}-held"
        #: Copies of each task id the kit sent to the worker.
        self.sent: Counter[str] = Counter()
        self.proxy: TcpProxy | None = None
        #: Why the store cannot be cut (``store_outage``), when it cannot.
        self.no_outage = ""
        env = self._store_environment(databases or {})
        self.worker = GuardedWorker(
            app=app_path,
            celery_app=celery_app,
            folder=folder,
            queue=self.queue,
            pool=pool,
            concurrency=concurrency,
            env=env,
        )

    # -- set-up ------------------------------------------------------------------------------------------

    def _store_environment(self, databases: dict[str, dict[str, Any]]) -> dict[str, str]:
        """The worker's store, through the kit's proxy where it can be: a Redis URL, or the Django database."""
        from celery_guardrails.stores import store_url

        env: dict[str, str] = {}
        url = store_url(self.celery_app)
        overrides = {alias: dict(values) for alias, values in databases.items()}
        if url == "django":
            default = overrides.get("default")
            if default is None:
                self.no_outage = "the store is the Django database, and the kit was given none"
            elif "sqlite" in (engine := str(default.pop("ENGINE", ""))):
                self.no_outage = "the store is a SQLite database: a file, with no connection to cut"
            else:
                host = str(default.get("HOST") or "127.0.0.1")
                if host.startswith("/"):
                    host = "127.0.0.1"  # a Unix socket: the proxy reaches the same server over TCP
                port = int(default.get("PORT") or (3306 if "mysql" in engine else 5432))
                self.proxy = TcpProxy(port, host=host)
                default.update(HOST="127.0.0.1", PORT=str(self.proxy.port))
        else:
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss") or "," in parts.netloc:
                self.no_outage = f"the store {parts.scheme}:// is not one Redis server the kit can put a proxy before"
            else:
                self.proxy = TcpProxy(parts.port or 6379, host=parts.hostname or "127.0.0.1")
                credentials = parts.netloc.rpartition("@")[0]
                netloc = f"{credentials}@127.0.0.1:{self.proxy.port}" if credentials else f"127.0.0.1:{self.proxy.port}"
                env["GUARDRAILS_KIT_STORE"] = urlunsplit(parts._replace(netloc=netloc))
        for values in overrides.values():
            values.pop("ENGINE", None)
        if overrides:
            env["GUARDRAILS_KIT_DATABASES"] = json.dumps(overrides)
        return env

    def start(self) -> Kit:
        # What the test process publishes without a queue (a view's delay(), a replay) reaches the kit's
        # worker: Celery's router reads the default queue at each publish.
        self._default_queue = self.celery_app.conf.task_default_queue
        self.celery_app.conf.task_default_queue = self.queue
        self.worker.start()
        return self

    def close(self) -> None:
        """Kill the worker, close the proxy, and drop the kit's queues. A SIGKILL, not a warm shutdown: the
        helpers have waited for every delivery to end, and a prefork pool's warm shutdown takes seconds per
        test; what the worker still held is given back to its queue, which is dropped."""
        try:
            self.worker.kill()
        finally:
            if hasattr(self, "_default_queue"):
                self.celery_app.conf.task_default_queue = self._default_queue
            if self.proxy is not None:
                self.proxy.close()
            self._drop_queues()

    def _drop_queues(self) -> None:
        with contextlib.suppress(Exception), self.celery_app.connection_for_write() as connection:
            channel = connection.default_channel
            for name in (self.queue, self.hold):
                with contextlib.suppress(*connection.channel_errors):
                    channel.queue_delete(name)

    # -- messages ----------------------------------------------------------------------------------------

    def capture(self, task: Any, *args: Any, publish_options: dict[str, Any] | None = None, **kwargs: Any) -> Captured:
        """Publish ``task(*args, **kwargs)`` through its own ``apply_async`` (to a queue no worker reads) and
        keep the message as it went out. ``publish_options``: more ``apply_async`` options (``headers``, a
        per-call guardrail option, ...); every helper takes it."""
        task_id = str(uuid.uuid4())
        found: list[Captured] = []

        def keep(
            sender: Any = None,
            body: Any = None,
            headers: dict[str, Any] | None = None,
            properties: dict[str, Any] | None = None,
            **_: Any,
        ) -> None:
            if headers and headers.get("id") == task_id:
                found.append(
                    Captured(
                        task_id,
                        str(headers.get("task") or sender),
                        copy.deepcopy(body),
                        copy.deepcopy(dict(headers)),
                        copy.deepcopy(dict(properties or {})),
                    )
                )

        before_task_publish.connect(keep, weak=False)
        try:
            task.apply_async(args, kwargs, task_id=task_id, queue=self.hold, **(publish_options or {}))
        finally:
            before_task_publish.disconnect(keep)
        if not found:
            raise KitError(f"{task.name}: nothing was published (did a guardrail skip the publish?)")
        return found[-1]

    def send(self, message: Captured, *, headers: dict[str, Any] | None = None, body: Any = None) -> None:
        """Deliver ``message`` to the kit's worker (again): the same body, headers and properties."""
        sent_headers = {**message.headers, **(headers or {})}
        properties = {k: v for k, v in message.properties.items() if k not in ("delivery_info",)}
        with self.celery_app.producer_or_acquire() as producer:
            producer.publish(
                message.body if body is None else body,
                exchange="",
                routing_key=self.queue,
                headers=sent_headers,
                serializer=self.celery_app.conf.task_serializer,
                retry=True,
                **properties,
            )
        self.sent[message.task_id] += 1

    # -- the worker's side -------------------------------------------------------------------------------

    def event_log(self) -> list[dict[str, Any]]:
        return events.read(self.folder / "events.jsonl")

    def messages(self) -> dict[str, events.Message]:
        return events.messages(self.event_log())

    def _plan(self, kind: str, key: str, *, at: str, times: int | None) -> None:
        """Add a rule to the agent's plan: ``kind`` (crash or pause) the deliveries of ``key`` (a task id or
        name) at the point ``at``, at most ``times`` times (None: every time)."""
        self._write_plan(kind, f"{key}@{at}", {"times": times})

    def _unplan(self, kind: str, key: str, *, at: str) -> None:
        self._write_plan(kind, f"{key}@{at}", None)

    def _write_plan(self, kind: str, name: str, rule: dict[str, Any] | None) -> None:
        """Written whole, then renamed: the agent never reads half a plan."""
        path = self.folder / "plan.json"
        plan = json.loads(path.read_text()) if path.exists() else {}
        rules = plan.setdefault(kind, {})
        if rule is None:
            rules.pop(name, None)
        else:
            rules[name] = rule
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(plan))
        os.replace(temporary, path)

    def _go(self, tokens: Iterable[str]) -> None:
        folder = self.folder / "go"
        folder.mkdir(exist_ok=True)
        for token in tokens:
            (folder / token).touch()

    def wait_until(self, what: str, probe: Callable[[], Any], *, timeout: float | None = None) -> Any:
        """Poll ``probe`` until it returns something truthy, restarting the worker whenever it died; KitError
        after ``timeout`` (the kit's settle bound)."""
        deadline = time.monotonic() + (timeout or self.settle_bound)
        while True:
            if self.worker.died():
                self.worker.start()
            found = probe()
            if found:
                return found
            if time.monotonic() > deadline:
                raise KitError(f"timed out waiting for {what}\n{self.describe()}")
            time.sleep(0.05)

    def _paused(self, task_id: str, count: int, *, at: str) -> list[str]:
        """The tokens of the deliveries of ``task_id`` held at ``at``, once there are ``count`` of them."""
        tokens = [
            e["token"] for e in self.event_log() if e["e"] == "paused" and e.get("id") == task_id and e.get("at") == at
        ]
        return tokens if len(tokens) >= count else []

    def settle(
        self, task_ids: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> dict[str, events.Message]:
        """Wait until each message sent (or each of ``task_ids``) has as many deliveries ended for good as
        copies were sent; restarts the worker whenever it died."""
        wanted = {task_id: self.sent[task_id] for task_id in (task_ids if task_ids is not None else self.sent)}

        def done() -> dict[str, events.Message] | None:
            found = self.messages()
            settled = all(found.get(task_id, events.Message(task_id)).settled >= n for task_id, n in wanted.items())
            return found if settled else None

        return dict(self.wait_until(f"{len(wanted)} message(s) to end", done, timeout=timeout))

    def report(self, task_ids: list[str], found: dict[str, events.Message], *, crashes: int = 0) -> Report:
        succeeded = [e["id"] for e in self.event_log() if e["e"] == "end" and e.get("outcome") == "succeeded"]
        return Report(task_ids, found, crashes=crashes, details={"succeeded_order": succeeded})

    def describe(self) -> str:
        """What the worker did, per task id the kit sent (for a failure's message)."""
        lines = []
        found = self.messages()
        for task_id, copies in self.sent.items():
            message = found.get(task_id, events.Message(task_id))
            ended = ", ".join(f"{o}{f' ({d})' if d else ''}" for o, d in message.outcomes) or "none"
            lines.append(
                f"  {message.task_name or '?'}[{task_id}]: sent {copies}, started {message.starts}, ended: {ended}"
            )
        log = "\n".join(self.worker.log.splitlines()[-40:])
        return "deliveries:\n" + "\n".join(lines) + f"\nworker log (end):\n{log}"

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
            args, kwargs = _split(item)
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
        args, kwargs = _split(item)
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
        from celery_guardrails.stores import django_apps_installed

        if not django_apps_installed():
            return {}
        from django_celery_guardrails.models import DeadLetter
        from django_celery_guardrails.replay import replay_dead_letters

        refused = DeadLetter.objects.filter(task_id__in=task_ids, reason="unknown_payload_version")
        if not refused.exists():
            return {}
        replay_dead_letters(refused, app=self.celery_app)
        replays = DeadLetter.objects.filter(task_id__in=task_ids).exclude(replayed_task_id="")
        return dict(replays.values_list("task_id", "replayed_task_id"))


def _max_deliveries(task: Any) -> int:
    from celery_guardrails.options import resolve

    try:
        return int(resolve(task, "max_deliveries", {}))
    except Exception:
        return POISON_BOUND - 2
