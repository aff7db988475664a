"""The logging filters: tenant, correlation id and task on each record (inside a task and outside), and the
extension's own lines redacted."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails import correlation_context, tenant_context
from celery_guardrails.foundation.redaction import WITHHELD
from celery_guardrails.log import ContextFilter, install_filters
from tests.proj import tasks
from tests.support import planted
from tests.support.planted import leaked

FORMAT = "tenant=%(tenant)s cid=%(correlation_id)s task=%(task_name)s[%(task_id)s] %(message)s"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = logging.getLogger("tests.proj")
    level = logger.level
    logger.setLevel(logging.INFO)  # the embedded worker sets the root logger to ERROR
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_task_log_lines_carry_the_context(celery_worker: Any, log_stream: io.StringIO) -> None:
    with tenant_context("acme"), correlation_context("req-log-1"):
        result = tasks.log_line.delay("inside the task")
    result.get(timeout=30)
    assert log_stream.getvalue().splitlines() == [
        f"tenant=acme cid=req-log-1 task=tests.proj.tasks.log_line[{result.id}] inside the task"
    ]


def test_outside_a_task_fields_are_dashes(log_stream: io.StringIO) -> None:
    logging.getLogger("tests.proj").warning("no context")
    with correlation_context("req-log-2"):
        logging.getLogger("tests.proj").warning("a request")
    assert log_stream.getvalue().splitlines() == [
        "tenant=- cid=- task=-[-] no context",
        "tenant=- cid=req-log-2 task=-[-] a request",
    ]


@pytest.fixture
def guardrails_output() -> Iterator[io.StringIO]:
    """What the extension's loggers write, formatted by a plain handler (tracebacks included)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    logger = logging.getLogger("celery_guardrails")
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def test_the_extensions_log_lines_and_tracebacks_are_redacted(celery_app: Any, guardrails_output: io.StringIO) -> None:
    # Given the filters a guarded task's app installs, and a line of one of the extension's modules about a store
    # error (it names the store's URL, password included) with its traceback
    install_filters()
    outcomes = logging.getLogger("celery_guardrails.runtime.outcomes")
    try:
        raise ConnectionError(f"Redis store at {planted.REDIS_URL} unavailable; token {planted.GITHUB_TOKEN}")
    except ConnectionError as error:
        outcomes.error("Task t[1]: the guardrails store is unavailable (%s)", error, exc_info=True)
    # Then the line and its traceback say everything but the secrets
    output = guardrails_output.getvalue()
    assert output.startswith(
        "celery_guardrails.runtime.outcomes Task t[1]: the guardrails store is unavailable (Redis store at "
        "redis://:[redacted]@cache:6379/0 unavailable; token [redacted])\nTraceback (most recent call last):"
    )
    assert leaked(output) == [] and "ConnectionError: Redis store at redis://:[redacted]@" in output


def test_a_line_with_nothing_to_redact_keeps_its_template(celery_app: Any) -> None:
    install_filters()
    record = logging.LogRecord(
        "celery_guardrails.operations.alerts", logging.INFO, __file__, 1, "sent %s to %s", ("a", "b"), None
    )
    assert logging.getLogger("celery_guardrails.operations.alerts").filter(record)
    assert (record.msg, record.args, record.getMessage()) == ("sent %s to %s", ("a", "b"), "sent a to b")


def test_the_filter_redacts_a_record_before_any_handler_reads_it() -> None:
    # Given records of the extension's loggers (a Django app's module too), with a traceback and Celery's data
    # extra, as a handler such as Sentry's would read them after the logger's filters
    try:
        raise ValueError(planted.MESSAGE)
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    for name in ("celery_guardrails.runtime.outcomes", "django_celery_guardrails.replay"):
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, "failed: %s", (planted.PG_URL,), exc_info)
        record.data = dict(planted.ARGUMENTS)
        # When the logger's filters have run
        assert logging.getLogger(name).filter(record)
        # Then the message, the data and the traceback are redacted, and the raw exception is gone
        assert record.exc_info is None and "[redacted]" in str(record.exc_text)
        assert leaked([record.getMessage(), record.exc_text, record.data]) == []


def test_a_record_the_filter_cannot_read_is_withheld_not_written_raw() -> None:
    # Given a record whose message cannot be made into text (its __str__ raises)
    class Unreadable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    record = logging.LogRecord(
        "celery_guardrails.runtime.outcomes", logging.ERROR, __file__, 1, Unreadable(), None, None
    )
    # When the filter runs, Then the line says it was withheld (and the record is still written)
    assert logging.getLogger("celery_guardrails.runtime.outcomes").filter(record)
    assert record.getMessage() == f"{WITHHELD}: a log line of celery_guardrails.runtime.outcomes"


def test_a_moment_in_a_log_line_reads_as_on_the_admin_pages_in_utc() -> None:
    from datetime import UTC, datetime, timedelta, timezone

    from celery_guardrails.log import moment_text, when

    # Given a moment, as epoch seconds and as datetimes in two zones
    instant = datetime(2026, 12, 2, 10, 31, 5, tzinfo=UTC).timestamp()
    paris = datetime(2026, 12, 2, 11, 31, 5, tzinfo=timezone(timedelta(hours=1)))
    # Then each reads one way, in UTC, to the second: no epoch, no ISO "T" and offset
    assert moment_text(instant) == moment_text(paris) == moment_text(paris.replace(tzinfo=None) - timedelta(hours=1))
    assert moment_text(instant) == "2026-12-02 10:31:05 UTC"
    # And a log line's time says how far from now
    assert when(instant, now=instant - 245) == "2026-12-02 10:31:05 UTC (in 4 min)"
    assert when(instant, now=instant + 12) == "2026-12-02 10:31:05 UTC (12 s ago)"
    assert when(instant, now=instant) == "2026-12-02 10:31:05 UTC (now)"
