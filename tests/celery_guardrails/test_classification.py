"""Classification rules, in order, on real exceptions from requests, httpx and urllib against a real server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry

from celery_guardrails import GuardedTask, PermanentError, RetryLater, TransientError
from celery_guardrails.classification import Kind, classify, parse_retry_after, sent_nothing

app = Celery("classification", set_as_current=False)


@app.task(
    base=GuardedTask,
    bind=True,
    idempotent=True,
    permanent_errors=(KeyError,),
    transient_errors=(LookupError, "builtins.ConnectionResetError"),
    error_patterns={r"(?i)not found": "permanent", r"(?i)try again": "transient"},
)
def configured(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True)
def plain(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, idempotency_key="order:{order_id}")
def keyed(self: GuardedTask, order_id: int) -> None: ...


@app.task(base=GuardedTask, bind=True, retry_unsafe=True)
def unsafe(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, transient_errors=(ConnectionError, TimeoutError))
def plain_with_transient_errors(self: GuardedTask) -> None: ...


def verdict(exc: BaseException, task: Any = configured, call: dict[str, Any] | None = None) -> tuple[str, str]:
    result = classify(exc, task, call or {})
    return result.kind.value, result.rule


def test_rules_in_order() -> None:
    assert verdict(Retry()) == ("control", "celery")
    assert verdict(Ignore()) == ("control", "celery")
    assert verdict(Reject()) == ("control", "celery")
    assert verdict(RetryLater("x", delay=3)) == ("retry_later", "RetryLater")
    assert verdict(TransientError("x")) == ("transient", "TransientError")
    assert verdict(PermanentError("x")) == ("permanent", "PermanentError")
    # permanent_errors is checked before transient_errors (KeyError is a LookupError)
    assert verdict(KeyError("x")) == ("permanent", "permanent_errors")
    assert verdict(IndexError("x")) == ("transient", "transient_errors")
    assert verdict(ConnectionResetError()) == ("transient", "transient_errors")
    # a remote error that arrives as text
    assert verdict(RuntimeError("RemoteError: order 7 Not Found")) == ("permanent", "error_patterns:(?i)not found")
    assert verdict(RuntimeError("busy, try again")) == ("transient", "error_patterns:(?i)try again")


def test_unknown_errors_depend_on_idempotency() -> None:
    assert verdict(RuntimeError("?")) == ("transient", "unknown_errors:auto:idempotent")
    assert verdict(RuntimeError("?"), plain) == ("permanent", "unknown_errors:auto:not_idempotent")
    assert verdict(RuntimeError("?"), keyed) == ("transient", "unknown_errors:auto:idempotent")
    app.conf.guardrails = {"unknown_errors": "transient"}
    try:
        # configured transient, but the task is not idempotent: the safety gate still says no
        assert verdict(RuntimeError("?"), plain) == ("permanent", "unknown_errors:transient:not_idempotent")
        assert verdict(RuntimeError("?"), unsafe) == ("transient", "unknown_errors:transient")
    finally:
        app.conf.guardrails = {}


STATUSES = [
    (408, "transient"),
    (425, "transient"),
    (429, "transient"),
    (500, "transient"),
    (503, "transient"),
    (599, "transient"),
    (400, "permanent"),
    (404, "permanent"),
    (422, "permanent"),
]


def failures_of(url: str, *, read_timeout: float = 5.0) -> list[BaseException]:
    """What requests, httpx and urllib raise for one GET of ``url``."""
    import httpx
    import requests

    errors: list[BaseException] = []
    for call in (
        lambda: requests.get(url, timeout=(5, read_timeout)).raise_for_status(),
        lambda: httpx.get(url, timeout=httpx.Timeout(read_timeout, connect=5)).raise_for_status(),
        lambda: urllib.request.urlopen(url, timeout=read_timeout),
    ):
        with pytest.raises(Exception) as caught:
            call()
        errors.append(caught.value)
    return errors


@pytest.mark.parametrize(("status", "kind"), STATUSES)
def test_http_statuses_from_requests_httpx_and_urllib(provider: str, status: int, kind: str) -> None:
    errors = failures_of(f"{provider}/status/{status}")
    # Given an idempotent task, Then the status decides
    assert [verdict(error, keyed) for error in errors] == [(kind, f"http:{status}")] * 3
    # Given a task that is not idempotent, Then only a status saying the request was not processed is
    # retried: a 5xx may come after the provider acted
    if status in (408, 425, 429) or kind == "permanent":
        assert [verdict(error, plain) for error in errors] == [(kind, f"http:{status}")] * 3
    else:
        assert [verdict(error, plain) for error in errors] == [("permanent", f"http:{status}:not_idempotent")] * 3
        assert [verdict(error, unsafe) for error in errors] == [(kind, f"http:{status}")] * 3


def test_retry_after_in_seconds_and_as_a_date(provider: str) -> None:
    import requests

    response = requests.get(f"{provider}/status/503?retry_after=7", timeout=5)
    with pytest.raises(requests.HTTPError) as caught:
        response.raise_for_status()
    assert classify(caught.value, keyed, {}).retry_after == 7.0
    with pytest.raises(urllib.error.HTTPError) as by_urllib:
        urllib.request.urlopen(f"{provider}/status/429?retry_after=3", timeout=5)
    assert classify(by_urllib.value, plain, {}).retry_after == 3.0
    when = datetime(2030, 1, 1, 12, 0, 10, tzinfo=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=(when - timedelta(seconds=10)).timestamp()) == 10.0
    assert parse_retry_after("yesterday-ish") is None


def test_a_refused_connection_is_retried_in_any_task() -> None:
    # Given nothing listening (the discard port), When requests, httpx and urllib try to connect
    errors = failures_of("http://127.0.0.1:9")
    # Then nothing was sent: retried even in a task that is not idempotent
    for error in errors:
        assert sent_nothing(error), repr(error)
        assert classify(error, plain, {}).kind is Kind.TRANSIENT, repr(error)
        assert classify(error, keyed, {}).kind is Kind.TRANSIENT, repr(error)


def test_a_name_that_does_not_resolve_is_retried_in_any_task() -> None:
    errors = failures_of("http://no-such-host.invalid/")
    for error in errors:
        assert sent_nothing(error), repr(error)
        assert classify(error, plain, {}).kind is Kind.TRANSIENT, repr(error)


def test_a_read_timeout_is_final_for_a_task_that_is_not_idempotent(provider: str) -> None:
    # Given a provider that received the request and answers too late (it may act on it meanwhile)
    errors = failures_of(f"{provider}/slow/2", read_timeout=0.3)
    for error in errors:
        # Then the request may have reached it: not retried unless the task is idempotent (or retry_unsafe)
        assert not sent_nothing(error), repr(error)
        assert classify(error, plain, {}).kind is Kind.PERMANENT, repr(error)
        assert classify(error, plain, {}).rule.endswith(":not_idempotent")
        assert classify(error, keyed, {}).kind is Kind.TRANSIENT, repr(error)
        assert classify(error, unsafe, {}).kind is Kind.TRANSIENT, repr(error)


def test_a_reset_after_sending_is_final_for_a_task_that_is_not_idempotent(provider: str) -> None:
    errors = failures_of(f"{provider}/reset")
    for error in errors:
        assert not sent_nothing(error), repr(error)
        assert classify(error, plain, {}).kind is Kind.PERMANENT, repr(error)
        assert classify(error, keyed, {}).kind is Kind.TRANSIENT, repr(error)


def test_transient_errors_of_a_task_that_is_not_idempotent_pass_the_gate_only_with_proof() -> None:
    # Given transient_errors=(ConnectionError, TimeoutError) on a task that is not idempotent
    # Then a refused connection (nothing sent) is retried; a reset or a timeout (maybe sent) is not
    assert verdict(ConnectionRefusedError(), plain_with_transient_errors) == ("transient", "transient_errors")
    assert verdict(ConnectionResetError(), plain_with_transient_errors) == (
        "permanent",
        "transient_errors:not_idempotent",
    )
    assert verdict(TimeoutError(), plain_with_transient_errors) == ("permanent", "transient_errors:not_idempotent")
    # And the author's own TransientError and RetryLater are their word, whatever the task
    assert verdict(TransientError("x"), plain) == ("transient", "TransientError")
    assert verdict(RetryLater("x"), plain) == ("retry_later", "RetryLater")


def test_http_libraries_are_not_imported_to_classify() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys
        from celery import Celery
        from celery_guardrails import GuardedTask
        from celery_guardrails.classification import classify
        app = Celery("x", set_as_current=False)
        def body(self):
            pass
        task = app.task(base=GuardedTask, bind=True)(body)
        classify(RuntimeError("boom"), task, {})
        print(sorted(m for m in ("requests", "httpx", "urllib3") if m in sys.modules))
    """),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
