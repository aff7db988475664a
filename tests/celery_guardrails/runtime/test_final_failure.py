"""The final-failure path records whatever a message holds, and whatever goes wrong while it does (issue #28):
an exception whose ``str()`` raises, a project guardrail that fails, arguments nested past the recursion limit.
Each ends in a dead letter (cut to what can be stored), never in an ack with nothing recorded."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_guardrails.runtime import dead_letters
from celery_guardrails.runtime.final_failure import FinalFailure
from celery_guardrails.runtime.outcomes import timestamp
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.dead_letters import dead_letter_of, has_dead_letter
from tests.support.waiting import wait_for


def test_an_exception_whose_str_raises_is_recorded_with_what_can_be_said_of_it(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given a task whose exception cannot be turned into text (its __str__ raises)
    result = tasks.raise_unprintable.delay(sink.key)
    # When it fails on a real worker
    with pytest.raises(Exception):  # noqa: B017 (the backend's copy of an unprintable exception)
        result.get(timeout=30)
    # Then it ran once and is a dead letter whose message says the text could not be read
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
    record = dead_letter_of(celery_app, result.id)
    assert len(sink.items()) == 1
    assert record["exc_type"] == "tests.proj.tasks.Unprintable"
    assert record["exc_message"] == "<tests.proj.tasks.Unprintable: its str() raised RuntimeError>"
    assert record["history"][-1]["msg"] == record["exc_message"]


def test_a_project_guardrail_that_fails_is_recorded_as_guardrail_error(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given a task whose project-level guardrail raises before the body (a bug)
    result = tasks.guarded_by_a_bug.delay(sink.key)
    # When a real worker runs it
    with pytest.raises(RuntimeError, match="BuggyGuardrail"):
        result.get(timeout=30)
    # Then the body never ran, and the message is a dead letter guardrail_error with the error and its history,
    # not an ack with nothing recorded
    wait_for("the dead letter", lambda: has_dead_letter(celery_app, result.id))
    record = dead_letter_of(celery_app, result.id)
    assert sink.items() == []
    assert (record["reason"], record["exc_type"]) == ("guardrail_error", "builtins.RuntimeError")
    assert "a bug in the project's own guardrail" in record["exc_message"]
    assert [(r["class"], r["rule"]) for r in record["history"]] == [("permanent", "guardrail_error")]
    assert "BuggyGuardrail.before_run" in record["traceback"]


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": [value]}
    return value


def test_arguments_nested_past_the_recursion_limit_are_recorded_cut(celery_app: Any, sink: Sink) -> None:
    # Given a final failure whose arguments and header are nested 3,000 levels deep (past the recursion limit
    # of every recursive walk: the redaction, the JSON encoder, a repr)
    failure = FinalFailure(
        task_name=tasks.observe.name,
        task_id=f"deep-{sink.key}",
        reason="permanent",
        exc_type="builtins.ValueError",
        exc_message="bad",
        tenant="acme",
        correlation_id=None,
        attempts=1,
        args=(nested(3000),),
        kwargs={"sink": nested(3000)},
        header={"x": nested(3000)},
        first_failed_at=timestamp(),
        last_failed_at=timestamp(),
    )
    # When it is recorded in the Redis stream sink
    new = dead_letters.record(tasks.observe, failure)
    # Then a record is written: who, what and why, with the arguments not kept whole
    assert new is True
    record = dead_letter_of(celery_app, failure.task_id)
    assert (record["task_name"], record["reason"], record["tenant"]) == (tasks.observe.name, "permanent", "acme")
    assert record["arguments_are_repr"] is True
    assert json.dumps(record)  # and what was stored reads back as JSON
