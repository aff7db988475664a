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
    """For each lost job (or job whose key was left claimed), what became of its last message: the last push of
    any of its copies (a publish, a retry, or kombu giving a message back to the queue), then what followed it."""
    wanted = set(jobs)
    files = sorted(broker_dir.glob("appendonlydir/*.incr.aof"))
    data = b"".join(path.read_bytes() for path in files)
    last_push: dict[str, tuple[int, str]] = {}  # job -> (position, delivery tag) of its newest push
    handed_out: dict[str, int] = {}  # tag -> position of its newest HSET into unacked
    removed: dict[str, int] = {}  # tag -> position of its newest HDEL from unacked
    for at, args in enumerate(commands(data)):
        name = args[0].upper()
        if name in (b"LPUSH", b"RPUSH") or (name == b"HSET" and args[1:2] == [b"unacked"]):
            found = _job_of(args[-1])
            if found is None or found[0] not in wanted:
                continue
            job, tag = found
            if name == b"HSET":
                handed_out[tag] = at
            else:
                last_push[job] = (at, tag)
        elif name == b"HDEL" and args[1:2] == [b"unacked"]:
            for tag in args[2:]:
                removed[tag.decode()] = at
    causes = {}
    for job in jobs:
        if job not in last_push:
            causes[job] = "never reached the broker"
            continue
        pushed_at, tag = last_push[job]
        # (a restore removes the tag from unacked, then pushes it again: only a hand-out after that push counts)
        if handed_out.get(tag, -1) < pushed_at:
            causes[job] = KOMBU_POP_WINDOW
        elif removed.get(tag, -1) > handed_out[tag]:
            causes[job] = "acked or rejected without a retry or an effect"
        else:
            causes[job] = "still handed out (unacked)"
    return causes
