"""The logging filter puts tenant, correlation id and task on each record, inside a task and outside."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from celery_guardrails import correlation_context, tenant_context
from celery_guardrails.log import ContextFilter
from tests.proj import tasks

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
