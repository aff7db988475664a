"""The soak's tracer reads a lost job's story from the broker's append-only file, in order."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from soak.trace import KOMBU_POP_WINDOW, lost_causes


def message(job: str, tag: str) -> bytes:
    body = base64.b64encode(json.dumps([[job], {}, {}]).encode()).decode()
    return json.dumps({"body": body, "properties": {"delivery_tag": tag}}).encode()


def resp(*args: bytes) -> bytes:
    return f"*{len(args)}\r\n".encode() + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)


def test_a_message_given_back_and_popped_again_by_a_killed_worker_is_kombus_window(tmp_path: Path) -> None:
    # Given an append-only file where job a's message was handed out, then given back to the queue (kombu's
    # restore: HDEL, then a push) and popped by a worker that died before recording it; job b's message was
    # handed out and acked; job c's was pushed, popped, and never recorded
    restored, acked, popped = message("a", "t-a"), message("b", "t-b"), message("c", "t-c")
    aof = tmp_path / "appendonlydir" / "appendonly.aof.1.incr.aof"
    aof.parent.mkdir()
    aof.write_bytes(
        resp(b"LPUSH", b"q", restored)
        + resp(b"RPOP", b"q")
        + resp(b"HSET", b"unacked", b"t-a", b"[" + restored + b', "", "q"]')
        + resp(b"LPUSH", b"q", acked)
        + resp(b"HSET", b"unacked", b"t-b", b"[" + acked + b', "", "q"]')
        + resp(b"HDEL", b"unacked", b"t-b")
        + resp(b"HDEL", b"unacked", b"t-a")
        + resp(b"LPUSH", b"q", restored)
        + resp(b"RPOP", b"q")
        + resp(b"LPUSH", b"q", popped)
        + resp(b"RPOP", b"q")
    )
    # When the tracer reads it
    causes = lost_causes(tmp_path, ["a", "b", "c", "d"])
    # Then the restored message's last push counts, not its earlier hand-out
    assert causes == {
        "a": KOMBU_POP_WINDOW,
        "b": "acked or rejected without a retry or an effect",
        "c": KOMBU_POP_WINDOW,
        "d": "never reached the broker",
    }
