"""Dead-letter records: the Redis stream sink, redaction, and arguments that are not JSON."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis

from celery_guardrails.foundation.redaction import redact_arguments
from celery_guardrails.runtime.dead_letters import LEGACY_MARKER, MARKER, STREAM, RedisStreamSink
from tests.proj import tasks
from tests.support.services import REDIS_URL


def stream_records(task_id: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(REDIS_URL)
    records = [json.loads(fields[b"record"]) for _, fields in client.xrevrange(STREAM, count=500)]
    return [r for r in records if r["task_id"] == task_id]


@pytest.mark.smoke
def test_redis_stream_sink_records_once_redacted(celery_worker: Any, celery_app: Any) -> None:
    # Given the Redis stream sink (the default without Django; the tests' default too)
    failed = tasks.behave.apply_async(
        (f"s-{uuid.uuid4().hex}", ["permanent"]), headers={"x-unrelated": "kept"}, correlation_id="req-stream-1"
    )
    with pytest.raises(Exception, match="refused"):
        failed.get(timeout=30)
    (record,) = stream_records(failed.id)
    assert (record["reason"], record["correlation_id"], record["arguments_are_repr"]) == (
        "permanent",
        "req-stream-1",
        False,
    )
    assert record["history"][-1]["class"] == "permanent"


def test_redaction_by_key_and_by_parameter_name() -> None:
    def charge(card_number: str, amount: int, **extra: Any) -> None: ...

    args, kwargs, as_repr = redact_arguments(
        charge, ["4111111111111111", 1999], {"meta": {"Authorization": "Bearer x", "note": "ok"}, "api_key": "k"}
    )
    assert (args, kwargs, as_repr) == (
        ["[redacted]", 1999],
        {"meta": {"Authorization": "[redacted]", "note": "ok"}, "api_key": "[redacted]"},
        False,
    )


def test_arguments_that_are_not_json_are_kept_as_repr_with_a_flag() -> None:
    def handle(when: Any, tags: Any, password: str = "") -> None: ...

    args, kwargs, as_repr = redact_arguments(handle, [{1, 2}, object.__new__(object)], {"password": "p"})
    assert as_repr is True
    assert args[0].startswith("[{1, 2}, <object object") and "p" not in kwargs["repr"].replace("password", "")
    assert kwargs == {"repr": "{'password': '[redacted]'}"}


def test_a_task_recorded_before_the_hash_tag_is_not_recorded_again() -> None:
    # Given a dead letter a previous release recorded (its marker under the old name) and one it did not
    old, new = f"tests-legacy-{uuid.uuid4().hex}", f"tests-new-{uuid.uuid4().hex}"
    client = redis.Redis.from_url(REDIS_URL)
    client.set(LEGACY_MARKER + old, 1, ex=600)
    sink = RedisStreamSink(REDIS_URL, timeout=5.0)
    # When the new release records both (the first redelivered after the upgrade)
    results = sink.record({"task_id": old}), sink.record({"task_id": new})
    # Then only the new one is recorded, its marker under the new name
    assert results == (False, True)
    assert (stream_records(old), len(stream_records(new))) == ([], 1)
    assert client.exists(MARKER + new) == 1
    client.delete(LEGACY_MARKER + old, MARKER + new)
