"""The test kit's event log: what a test worker's processes did, one JSON line each, read by the test.

Every process of a kit worker (the main process and each pool child) appends to one file with ``O_APPEND``
(a line is written by one ``write``, so lines of different processes never interleave) and never buffers:
a process SIGKILLed right after a write has its line on disk. The test reads the whole file when it polls.

Events (``e``): ``ready`` (the worker consumes), ``start`` (a delivery's body is about to run: Celery's
``task_prerun``), ``end`` (a delivery ended, with ``outcome`` and ``detail``), ``point`` (a fault point was
reached), ``paused`` (a delivery waits at a point for the test's go), ``crash`` (the worker is SIGKILLed now).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Outcomes after which a message is settled: nothing of it is left to run (see signals.delivery_ended).
TERMINAL = frozenset({"succeeded", "skipped", "duplicate_skipped", "dead_lettered", "failed", "rejected", "ignored"})


def write(path: Path | str, kind: str, **fields: Any) -> None:
    """Append one event to the log at ``path``."""
    line = json.dumps({"e": kind, "pid": os.getpid(), "t": time.time(), **fields}, default=str) + "\n"
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


def read(path: Path | str) -> list[dict[str, Any]]:
    """Every whole event in the log at ``path`` (a line being written is left for the next read)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    events = []
    for line in raw.split(b"\n")[:-1]:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


@dataclass
class Message:
    """What the worker did with one task id: its deliveries started and how each ended."""

    task_id: str
    task_name: str = ""
    starts: int = 0
    outcomes: list[tuple[str, str]] = field(default_factory=list)
    points: list[str] = field(default_factory=list)

    @property
    def settled(self) -> int:
        """How many of its deliveries ended for good (a copy skipped, the message done or dead-lettered)."""
        return sum(1 for outcome, _ in self.outcomes if outcome in TERMINAL)


def messages(events: Iterable[dict[str, Any]]) -> dict[str, Message]:
    """The events of a log, gathered per task id, in the order they were written."""
    found: dict[str, Message] = {}
    for event in events:
        task_id = event.get("id")
        if not task_id:
            continue
        message = found.setdefault(task_id, Message(task_id))
        message.task_name = event.get("task") or message.task_name
        if event["e"] == "start":
            message.starts += 1
        elif event["e"] == "end":
            message.outcomes.append((str(event.get("outcome")), str(event.get("detail") or "")))
        elif event["e"] == "point":
            message.points.append(str(event.get("name")))
    return found
