"""No planted secret escapes a guarded task's failure on a real worker: not the dead letter (message, traceback,
history, arguments), not a log line (the guardrails' or Celery's own), not an alert, not the result backend.
A plain Celery task's failure is left exactly as Celery makes it."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chord

from celery_guardrails.foundation.redaction import REDACTED
from celery_guardrails.stores import get_store
from celery_guardrails.stores.redis import ALERT_PENDING, ALERT_PREFIX
from tests.conftest import Sink
from tests.proj import leaky, tasks
from tests.support import planted
from tests.support.dead_letters import dead_letter_of
from tests.support.planted import leaked
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for

#: The loggers a worker writes a task's failure with: Celery's (the trace's "raised unexpected", "retry") and
#: the extension's (the final failure, the alert).
LOGGERS = ("celery", "celery_guardrails")


@pytest.fixture
def log_output() -> Iterator[io.StringIO]:
    """What the worker logs at INFO and above, formatted as a handler would (tracebacks included)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    saved = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.INFO)  # the embedded worker leaves Celery's loggers at WARNING
        logger.addHandler(handler)
    try:
        yield stream
    finally:
        for logger, level in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)


def stored_meta(task_id: str) -> bytes:
    """The result backend's raw entry, as Redis holds it."""
    raw = redis.Redis.from_url(REDIS_URL).get(f"celery-task-meta-{task_id}")
    assert raw is not None, f"no result stored for {task_id}"
    return bytes(raw)


def test_no_planted_secret_escapes_a_guarded_tasks_failure(
    celery_app: Any, celery_worker: Any, log_output: io.StringIO, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    url, posted = webhook
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "alert_channels": ["log", "webhook"],
        "alert_webhooks": [url],
    }
    group = "security|tests.proj.leaky.leak|permanent"  # a fresh throttle window (Redis outlives test runs)
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(ALERT_PREFIX + group)
    client.srem(ALERT_PENDING, group)
    # Given a guarded task whose arguments (under names that are not sensitive) and exception hold every
    # planted secret, which fails once transiently (retried) and then for good
    arguments = dict(planted.ARGUMENTS)
    result = leaky.leak.apply_async((arguments.pop("dsn"), arguments.pop("headers")), arguments)
    # When its failure comes back to the caller
    with pytest.raises(leaky.LeakyError) as raised:
        result.get(timeout=30)
    # Then it is the task's own exception type, its message redacted, the rest of it kept
    assert leaked(str(raised.value)) == [] and str(raised.value).startswith("could not connect to postgresql://app:")
    assert REDACTED in str(raised.value)
    assert leaked(result.traceback) == [] and "LeakyError" in result.traceback
    # And the dead letter holds no secret: message, traceback, both attempts' history, arguments
    record = dead_letter_of(celery_app, result.id)
    assert leaked(record) == []
    assert [entry["class"] for entry in record["history"]] == ["transient", "permanent"]
    assert all(REDACTED in entry["msg"] for entry in record["history"])
    assert record["args"] == [REDACTED, [["authorization", REDACTED], ["X-Api-Key", REDACTED]]]
    assert record["kwargs"] == {"note": REDACTED, "urls": [REDACTED] * 4, "pem": REDACTED, "auth": REDACTED}
    # And the result backend's raw entry neither
    meta = stored_meta(result.id)
    assert leaked(meta) == []
    stored = json.loads(meta)
    assert (stored["status"], stored["result"]["exc_type"]) == ("FAILURE", "LeakyError")
    # And the alert (webhook and log channel) neither
    alert = wait_for("the alert", lambda: [p for p in posted if p.get("dead_letter", {}).get("task_id") == result.id])
    assert leaked(alert) == [] and alert[0]["dead_letter"]["exc_message"].startswith("could not connect")
    # And no log line of the worker: Celery's retry and "raised unexpected" (with the traceback), the final failure
    wait_for("the alert's log line", lambda: "ALERT for security" in log_output.getvalue())
    # (Celery logs "raised unexpected" after on_failure has recorded and alerted: wait for it too)
    wait_for("Celery's failure line", lambda: f"leak[{result.id}] raised unexpected" in log_output.getvalue())
    output = log_output.getvalue()
    assert leaked(output) == []
    for line in (
        f"Task tests.proj.leaky.leak[{result.id}] retry: Retry in",
        f'Task tests.proj.leaky.leak[{result.id}] raised unexpected: LeakyError("could not connect to postgresql',
        f"Task tests.proj.leaky.leak[{result.id}] failed finally (permanent)",
        "Traceback (most recent call last)",
    ):
        assert line in output, line


def test_a_plain_celery_tasks_failure_is_left_as_celery_makes_it(celery_worker: Any, log_output: io.StringIO) -> None:
    # Given a plain Celery task (not guarded) failing with the same message
    result = leaky.plain_leak.delay()
    with pytest.raises(leaky.LeakyError, match=re.escape(planted.STRIPE_KEY)):
        result.get(timeout=30)
    # Then its result, its traceback and Celery's log line keep every word of it
    assert leaked(stored_meta(result.id)) == list(planted.SECRETS)
    wait_for("Celery's log line", lambda: f"plain_leak[{result.id}] raised unexpected" in log_output.getvalue())
    assert leaked(log_output.getvalue()) == list(planted.SECRETS)
    result.forget()  # (a test that reads every key of this Redis database must not find this one's secrets)


def test_an_exception_with_attributes_of_its_own_is_rebuilt_redacted(celery_worker: Any) -> None:
    # Given an exception with its own __init__ and __str__ (an HTTP client's error)
    result = leaky.leak_provider.delay(planted.HTTPS_URL)
    with pytest.raises(leaky.ProviderError) as raised:
        result.get(timeout=30)
    # Then the caller gets the same type, rebuilt from redacted arguments, and the stored entry says no secret
    assert (raised.value.status, raised.value.url) == (401, "https://deploy:[redacted]@git.example.com/shop.git")
    assert leaked(stored_meta(result.id)) == []


def test_a_chord_and_an_errback_see_the_failure_redacted(celery_worker: Any, sink: Sink) -> None:
    # Given a chord whose header has a guarded part that fails with a secret
    failed = chord([leaky.leak_provider.s(planted.PG_URL), tasks.observe.s()], tasks.collect.s()).delay()
    # Then the caller gets the part's exception, and the chord's callback is stored failed as Celery makes it
    # fail, naming the part's exception redacted
    with pytest.raises(leaky.ProviderError, match=re.escape("401 from postgresql://app:[redacted]@db/shop")):
        failed.get(timeout=30)
    meta = wait_for("the chord's result", lambda: redis.Redis.from_url(REDIS_URL).get(f"celery-task-meta-{failed.id}"))
    stored = json.loads(meta)
    assert (stored["status"], stored["result"]["exc_type"]) == ("FAILURE", "ChordError")
    assert "raised ProviderError(401, 'postgresql://app:[redacted]@db/shop')" in stored["result"]["exc_message"][0]
    assert leaked(meta) == []
    # And an errback still runs for a guarded task's failure, with the failure stored redacted
    result = leaky.leak_provider.apply_async((planted.PG_URL,), link_error=tasks.record_errback.s(sink=sink.key))
    with pytest.raises(leaky.ProviderError):
        result.get(timeout=30)
    (report,) = sink.wait(1)
    assert report["failed_task_id"] == result.id
    assert leaked(stored_meta(result.id)) == []


def test_a_failed_keys_reason_holds_no_secret(celery_app: Any, celery_worker: Any) -> None:
    # Given a keyed task that fails for good: its key is marked failed with the reason, which a duplicate's
    # caller is told and the admin shows
    order = str(uuid.uuid4())
    with pytest.raises(leaky.LeakyError):
        leaky.leak_keyed.delay(order).get(timeout=30)
    store, key = get_store(celery_app), f"{leaky.leak_keyed.name}:-:leak:{order}"
    state = wait_for(
        "the key failed", lambda: (store.inspect(key) or {}).get("state") == "failed" and store.inspect(key)
    )
    # Then that reason says what failed, redacted
    assert state["reason"].startswith("LeakyError: could not connect to postgresql://app:[redacted]@db/shop")
    assert leaked(state["reason"]) == []


@pytest.mark.parametrize("celery_worker_parameters", [{"task_events": True}], indirect=True)
def test_the_task_events_of_a_guarded_failure_carry_no_secret(celery_app: Any, celery_worker: Any) -> None:
    # Given a worker that sends task events, and a receiver of them (as Flower or `celery events` is: on a Redis
    # broker they are published to whoever listens at the time)
    seen: list[dict[str, Any]] = []
    with celery_app.connection_for_read() as connection:
        receiver = celery_app.events.Receiver(connection, handlers={"*": seen.append})
        listening = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None), daemon=True)
        listening.start()
        try:
            # (it listens once an event sent now reaches it: before, the task's first events could pass it by)
            with celery_app.events.default_dispatcher() as dispatcher:
                wait_for("the receiver listening", lambda: dispatcher.send("worker-probe") or _probed(seen), every=0.2)
            # When a guarded task whose exception holds every planted secret is retried, then fails for good
            arguments = dict(planted.ARGUMENTS)
            result = leaky.leak.apply_async((arguments.pop("dsn"), arguments.pop("headers")), arguments)
            with pytest.raises(leaky.LeakyError):
                result.get(timeout=30)
            wait_for("the task-failed event", lambda: _event(seen, "task-failed", result.id))
        finally:
            receiver.should_stop = True
            listening.join(timeout=10)
    # Then its task-retried and task-failed events carry the exception and the traceback redacted
    ours = [*_event(seen, "task-retried", result.id), *_event(seen, "task-failed", result.id)]
    assert {event["type"] for event in ours} == {"task-retried", "task-failed"}
    assert all(REDACTED in event["exception"] and REDACTED in event["traceback"] for event in ours)
    assert leaked(ours) == []


def _probed(seen: list[dict[str, Any]]) -> bool:
    return any(event.get("type") == "worker-probe" for event in list(seen))


def _event(seen: list[dict[str, Any]], kind: str, task_id: str) -> list[dict[str, Any]]:
    return [event for event in list(seen) if event.get("type") == kind and event.get("uuid") == task_id]
