"""The test kit's harness: what its helpers (:class:`~celery_guardrails.testing.kit.Kit`) are built from.

A :class:`KitHarness` owns one :class:`~celery_guardrails.testing.worker.GuardedWorker` consuming a queue of its
own, a second queue no worker reads (where messages are captured as they are first published), and a proxy in
front of the store when the store is reachable over TCP (so that a helper can cut it). It captures and sends
messages, writes the plan the worker's agent reads (crash or pause a delivery at a point), and waits until the
deliveries it caused have ended for good, restarting the worker whenever it died.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

from celery.signals import before_task_publish

from celery_guardrails.testing import events
from celery_guardrails.testing.proxy import TcpProxy
from celery_guardrails.testing.reports import Captured, KitError, Report
from celery_guardrails.testing.worker import GuardedWorker, Launcher, start_process

#: Seconds a helper waits for the deliveries it caused to end before it fails (a machine that has stopped,
#: not a measure of speed).
SETTLE_BOUND = 120.0


class KitHarness:
    """The worker, queues and store proxy of one kit, and the steps its helpers are made of (see the module
    docstring)."""

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
        launcher: Launcher = start_process,
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
            launcher=launcher,
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

    def start(self) -> Self:
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
