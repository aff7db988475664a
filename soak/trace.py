"""Where a lost job's messages went, read from the soak broker's append-only file (every write Redis took).

kombu's Redis transport pushes a message onto the queue (LPUSH), pops it (BRPOP, written as RPOP), records it
as handed out (HSET ``unacked``), and removes it from there when it is acked or rejected (HDEL). A message
pushed and never recorded as handed out was popped by a worker that died before it could record it: kombu's
pop is not atomic with that record (celery/kombu#305), no guardrail ever saw it. Anything else is ours.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The cause given to a message popped by a worker that died before recording it as handed out.
KOMBU_POP_WINDOW = "popped by a worker killed before kombu recorded it as handed out (celery/kombu#305)"


def commands(data: bytes) -> Iterator[list[bytes]]:
    """The commands of an append-only file (RESP arrays of bulk strings)."""
    at, end = 0, len(data)
    while at < end:
        if data[at : at + 1] != b"*":  # not a command: skip the line
            at = data.index(b"\n", at) + 1
            continue
        eol = data.index(b"\r\n", at)
        count, at = int(data[at + 1 : eol]), eol + 2
        args = []
        for _ in range(count):
            eol = data.index(b"\r\n", at)
            length, at = int(data[at + 1 : eol]), eol + 2
            args.append(data[at : at + length])
            at += length + 2
        yield args


def _job_of(payload: bytes) -> tuple[str, str] | None:
    """(job id, delivery tag) of a kombu message (a pushed one, or the first item of an ``unacked`` value)."""
    try:
        message: Any = json.loads(payload)
        if isinstance(message, list):
            message = message[0]
        body = json.loads(base64.b64decode(message["body"]))
        return str(body[0][0]), str(message["properties"]["delivery_tag"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def lost_causes(broker_dir: Path, jobs: list[str]) -> dict[str, str]:
    """For each lost job, what became of its last message."""
    wanted = set(jobs)
    files = sorted(broker_dir.glob("appendonlydir/*.incr.aof"))
    data = b"".join(path.read_bytes() for path in files)
    pushed: dict[str, list[str]] = {job: [] for job in jobs}  # job -> delivery tags, in order
    handed_out: set[str] = set()
    removed: set[str] = set()
    for args in commands(data):
        name = args[0].upper()
        if name in (b"LPUSH", b"RPUSH") or (name == b"HSET" and args[1:2] == [b"unacked"]):
            found = _job_of(args[-1])
            if found is None or found[0] not in wanted:
                continue
            job, tag = found
            if name == b"HSET":
                handed_out.add(tag)
            elif tag not in pushed[job]:
                pushed[job].append(tag)
        elif name == b"HDEL" and args[1:2] == [b"unacked"]:
            removed.update(tag.decode() for tag in args[2:])
    causes = {}
    for job in jobs:
        if not pushed[job]:
            causes[job] = "never reached the broker"
            continue
        last = pushed[job][-1]
        if last not in handed_out:
            causes[job] = KOMBU_POP_WINDOW
        elif last in removed:
            causes[job] = "acked or rejected without a retry or an effect"
        else:
            causes[job] = "still handed out (unacked)"
    return causes
