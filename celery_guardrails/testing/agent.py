"""The test kit's agent: runs inside a worker the kit starts (``python -m celery_guardrails.testing.agent
-A app worker ...``), in its main process and every pool child.

It writes what the worker does to the kit's event log (:mod:`celery_guardrails.testing.events`), and carries
out the test's plan (``plan.json`` in the kit's folder, read at each point: ``{"crash"|"pause": {"<task id or
name>@<point>": {"times": n or null}}}``): SIGKILL the whole worker, or hold the delivery until the test says
go, when a given task id reaches a given point, at most ``times`` times. The points are ``start``
(before the guardrails and the body: Celery's ``task_prerun``), ``after_body`` (the body returned and the
guardrails recorded it, before the ack: ``task_postrun``) and every :func:`celery_guardrails.fault_point`.

Set up from the environment the kit gives the worker:

``GUARDRAILS_KIT_DIR``
    The kit's folder (event log, plan, counters, go files).
``GUARDRAILS_KIT_QUEUE``
    The queue the worker consumes, made the app's default queue, so that what the tasks publish without a
    queue (a retry, a chain's next step) stays on the kit's worker.
``GUARDRAILS_KIT_STORE``
    A Redis store URL to use instead of the app's (the kit's TCP proxy in front of it, to cut it).
``GUARDRAILS_KIT_DATABASES``
    JSON ``{alias: {setting: value}}`` laid over Django's ``DATABASES`` before any connection: the test
    database pytest-django made, reached through the kit's proxy.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from celery.signals import celeryd_init, task_postrun, task_prerun, worker_ready

from celery_guardrails import signals
from celery_guardrails.foundation import faults
from celery_guardrails.testing import events

#: Seconds a delivery paused at a point waits for the test's go before it goes on by itself.
PAUSE_BOUND = 300.0
#: Celery's final states, as the kit names a delivery's end when no guardrail told one (a plain task).
STATES = {"SUCCESS": "succeeded", "FAILURE": "failed", "RETRY": "retried", "IGNORED": "ignored"}

_folder = Path(os.environ.get("GUARDRAILS_KIT_DIR", "."))
_current = threading.local()


def _log(kind: str, **fields: Any) -> None:
    events.write(_folder / "events.jsonl", kind, **fields)


def _plan() -> dict[str, Any]:
    try:
        plan: dict[str, Any] = json.loads((_folder / "plan.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return plan


def _fire(kind: str, task_id: str, at: str, times: int | None) -> int | None:
    """Count one firing of a rule; the firing's number, or None when the rule has fired ``times`` already."""
    counter = _folder / "fired" / f"{kind}-{task_id}-{at}"
    counter.parent.mkdir(exist_ok=True)
    descriptor = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # Two copies of a message in two processes reach a point together: the count and its increment are
        # one step under the file's lock, or both would see the rule unfired (and both be held).
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        fired = os.fstat(descriptor).st_size
        if times is not None and fired >= times:
            return None
        os.write(descriptor, b"x")
    finally:
        os.close(descriptor)
    return fired + 1


def act(task_id: str | None, task_name: str, at: str) -> None:
    """Carry out the plan's rules for ``task_id`` (or ``*``) at the point ``at``: pause first, then crash."""
    if not task_id:
        return
    plan = _plan()
    for kind in ("pause", "crash"):
        rules = plan.get(kind) or {}
        rule = rules.get(f"{task_id}@{at}") or rules.get(f"{task_name}@{at}") or rules.get(f"*@{at}")
        if not rule:
            continue
        number = _fire(kind, task_id, at, rule.get("times"))
        if number is None:
            continue
        if kind == "pause":
            _pause(task_id, task_name, at, number)
        else:
            _log("crash", id=task_id, task=task_name, at=at)
            os.killpg(os.getpgid(0), signal.SIGKILL)


def _pause(task_id: str, task_name: str, at: str, number: int) -> None:
    token = f"{task_id}.{at}.{number}"
    _log("paused", id=task_id, task=task_name, at=at, token=token)
    go = _folder / "go" / token
    deadline = time.monotonic() + PAUSE_BOUND
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _point(name: str) -> None:
    """The handler of :func:`celery_guardrails.fault_point` in this process."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    _reached(getattr(request, "id", None), getattr(current_task, "name", "") or "", name)


def _reached(task_id: str | None, task_name: str, name: str) -> None:
    _log("point", id=task_id, task=task_name, name=name)
    act(task_id, task_name, name)


def _on_ready(sender: Any = None, **_: Any) -> None:
    _log("ready", hostname=getattr(sender, "hostname", ""))


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    name = getattr(task, "name", "") or ""
    info = getattr(getattr(task, "request", None), "delivery_info", None) or {}
    _current.delivery = {"id": task_id, "told": None}
    _log("start", id=task_id, task=name, redelivered=bool(info.get("redelivered")))
    act(task_id, name, "start")
    if not hasattr(task, "guardrails"):  # a plain task's body runs next (GuardedTask marks "body" itself)
        _reached(task_id, name, "body")


def _on_postrun(
    sender: Any = None, task_id: str | None = None, task: Any = None, state: str = "", retval: Any = None, **_: Any
) -> None:
    name = getattr(task, "name", "") or ""
    act(task_id, name, "after_body")
    current = getattr(_current, "delivery", None) or {}
    _current.delivery = None
    told = current.get("told") if current.get("id") == task_id else None
    if told is not None:
        outcome, detail = told
    elif state == "REJECTED":
        # Reject(requeue=True) gives the message back to the broker: it comes again (not an end).
        outcome, detail = ("returned" if getattr(retval, "requeue", False) else "rejected"), ""
    else:
        outcome, detail = STATES.get(state, state.lower()), ""
    _log("end", id=task_id, task=name, outcome=outcome, detail=detail)


def _on_delivery_ended(
    sender: Any = None, task_id: str | None = None, task_name: str = "", outcome: str = "", detail: str = "", **_: Any
) -> None:
    current = getattr(_current, "delivery", None)
    if current is not None and current.get("id") == task_id:
        current["told"] = (outcome, detail)  # written at task_postrun, with the run's end
    else:  # told outside a run: a message the consumer refused, a child killed by its time limit
        _log("end", id=task_id, task=task_name, outcome=outcome, detail=detail)


def _on_init(sender: Any = None, conf: Any = None, **_: Any) -> None:
    queue = os.environ.get("GUARDRAILS_KIT_QUEUE")
    if queue:
        conf.task_default_queue = queue
    store = os.environ.get("GUARDRAILS_KIT_STORE")
    if store:
        conf.guardrails = {**(conf.get("guardrails") or {}), "store": store}


def _configure_django() -> None:
    databases = json.loads(os.environ.get("GUARDRAILS_KIT_DATABASES") or "{}")
    if not databases:
        return
    from django.conf import settings

    for alias, values in databases.items():  # before any connection is made: they read these when first used
        settings.DATABASES[alias].update(values)


def install() -> None:
    """Connect the agent in this process (its pool children inherit it)."""
    celeryd_init.connect(_on_init, weak=False, dispatch_uid="guardrails.kit.init")
    worker_ready.connect(_on_ready, weak=False, dispatch_uid="guardrails.kit.ready")
    task_prerun.connect(_on_prerun, weak=False, dispatch_uid="guardrails.kit.prerun")
    task_postrun.connect(_on_postrun, weak=False, dispatch_uid="guardrails.kit.postrun")
    signals.delivery_ended.connect(_on_delivery_ended, weak=False, dispatch_uid="guardrails.kit.ended")
    faults.arm(_point)


def main(argv: list[str] | None = None) -> None:
    """``python -m celery_guardrails.testing.agent <celery arguments>``: Celery's command, with the agent."""
    _configure_django()
    install()
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", *(sys.argv[1:] if argv is None else argv)]
    celery_main()


if __name__ == "__main__":
    main()
