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

from celery_guardrails import GuardedTask, PermanentError, RetryLater, SlotLostError, TransientError
from celery_guardrails.options import TaskOptions
from celery_guardrails.runtime.classification import Kind, classify, parse_retry_after
from celery_guardrails.runtime.delivery import Delivery
from celery_guardrails.runtime.wire import sent_nothing

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


@app.task(base=GuardedTask, bind=True)
def marked(self: GuardedTask) -> None:
    with self.effect():
        pass


@app.task(base=GuardedTask, bind=True, idempotency_key="order:{order_id}")
def keyed(self: GuardedTask, order_id: int) -> None: ...


@app.task(base=GuardedTask, bind=True, retry_unsafe=True)
def unsafe(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, transient_errors=(ConnectionError, TimeoutError))
def marked_with_transient_errors(self: GuardedTask) -> None:
    with self.effect():
        pass


@app.task(base=GuardedTask, bind=True, autoretry_for=(Exception,), dont_autoretry_for=(OSError,))
def autoretried(self: GuardedTask) -> None: ...


#: Deliveries as the gate sees them: nothing happened yet; the key handed on before any effect; an effect done.
FRESH = Delivery()
KEY_HANDED = Delivery(key="tests:-:order:1", key_read_at=0)
KEY_UNREAD = Delivery(key="tests:-:order:1")
AFTER_EFFECT = Delivery(effects=1)


def verdict(
    exc: BaseException, task: Any = configured, call: dict[str, Any] | None = None, state: Delivery = FRESH
) -> tuple[str, str]:
    result = classify(exc, TaskOptions(task=task, call=call or {}), state)
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
    # a transient_errors class at least as specific as the deterministic one wins (LookupError, IndexError)
    assert verdict(IndexError("x")) == ("transient", "transient_errors")
    assert verdict(ConnectionResetError()) == ("transient", "transient_errors")
    # a remote error that arrives as text
    assert verdict(RuntimeError("RemoteError: order 7 Not Found")) == ("permanent", "error_patterns:(?i)not found")
    assert verdict(RuntimeError("busy, try again")) == ("transient", "error_patterns:(?i)try again")


def test_unknown_errors_are_retried_only_where_a_rerun_is_safe() -> None:
    # Given an unclassified error, Then "auto" makes it transient and the gate decides
    assert verdict(RuntimeError("?")) == ("transient", "unknown_errors:auto")  # idempotent=True
    assert verdict(RuntimeError("?"), plain) == ("permanent", "unknown_errors:auto:not_idempotent")
    assert verdict(RuntimeError("?"), marked) == ("transient", "unknown_errors:auto")  # before its first effect
    assert verdict(RuntimeError("?"), marked, state=AFTER_EFFECT) == ("permanent", "unknown_errors:auto:not_idempotent")
    assert verdict(RuntimeError("?"), keyed, state=KEY_UNREAD) == ("permanent", "unknown_errors:auto:not_idempotent")
    assert verdict(RuntimeError("?"), keyed, state=KEY_HANDED) == ("transient", "unknown_errors:auto")
    app.conf.guardrails = {"unknown_errors": "transient"}
    try:
        # configured transient, but the task is not idempotent: the safety gate still says no
        assert verdict(RuntimeError("?"), plain) == ("permanent", "unknown_errors:transient:not_idempotent")
        assert verdict(RuntimeError("?"), unsafe) == ("transient", "unknown_errors:transient")
    finally:
        app.conf.guardrails = {}


def test_a_delivery_whose_slot_was_reaped_waits_for_it_again_only_where_a_rerun_is_safe() -> None:
    # Given a holder fenced (SlotLostError: its concurrency slot was reaped while it stalled)
    lost = SlotLostError("limit:tenant:acme", "host:1:id:n.0", "effect")
    ran = Delivery(body_ran=True)
    # Then stopped before its body it waits for a slot again, no attempt spent, whatever the task
    assert verdict(lost, plain) == ("retry_later", "concurrency:slot_lost")
    # and stopped inside its body, the gate decides: before the first marked effect (or idempotent) it waits too
    assert verdict(lost, marked, state=ran) == ("retry_later", "concurrency:slot_lost")
    assert verdict(lost, configured, state=ran) == ("retry_later", "concurrency:slot_lost")
    # after an effect, or in a body that marks none, it is a final failure not_idempotent, with the gate's note
    after = Delivery(body_ran=True, effects=1)
    assert verdict(lost, marked, state=after) == ("permanent", "concurrency:slot_lost:not_idempotent")
    assert verdict(lost, plain, state=ran) == ("permanent", "concurrency:slot_lost:not_idempotent")
    assert "chain it" in str(classify(lost, TaskOptions(task=marked), after).note)


def test_a_refused_verdict_says_why_and_what_to_do() -> None:
    # Given a body that marks nothing, When a transient failure is not retried
    note = classify(ConnectionRefusedError(), TaskOptions(task=plain), FRESH).note
    # Then the note names the cause and the three ways out
    assert note is not None and "marks no effect" in note
    assert "self.effect()" in note and "self.request.idempotency_key" in note and "idempotent=True" in note
    assert "chain it" in str(classify(TimeoutError(), TaskOptions(task=marked), AFTER_EFFECT).note)
    assert "never handed its idempotency key" in str(classify(TimeoutError(), TaskOptions(task=keyed), KEY_UNREAD).note)
    assert classify(TimeoutError(), TaskOptions(task=keyed), KEY_HANDED).note is None


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad"),
        TypeError("bad"),
        KeyError("k"),
        AttributeError("a"),
        LookupError("l"),
        NotImplementedError(),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
        IndexError(1),
    ],
)
def test_deterministic_errors_are_permanent_in_every_task(error: BaseException) -> None:
    # Given an error no retry can fix, Then it is permanent even where a rerun would be safe
    for task, state in ((plain, FRESH), (keyed, KEY_HANDED), (unsafe, FRESH), (autoretried, FRESH)):
        assert verdict(error, task, state=state) == ("permanent", "deterministic_errors"), (task.name, error)


def test_validation_errors_of_django_and_pydantic_are_deterministic() -> None:
    from django.core.exceptions import ValidationError

    assert verdict(ValidationError("no"), keyed, state=KEY_HANDED) == ("permanent", "deterministic_errors")
    pydantic = pytest.importorskip("pydantic")

    class Model(pydantic.BaseModel):
        n: int

    with pytest.raises(pydantic.ValidationError) as caught:
        Model(n="x")
    assert verdict(caught.value, keyed, state=KEY_HANDED) == ("permanent", "deterministic_errors")


def test_deterministic_errors_can_be_overridden_per_task_and_app() -> None:
    # a transient_errors class at least as specific wins; () on the app turns the rule off
    assert verdict(KeyError("k"), configured) == ("permanent", "permanent_errors")
    assert verdict(IndexError(1), configured) == ("transient", "transient_errors")
    app.conf.guardrails = {"deterministic_errors": ()}
    try:
        assert verdict(ValueError("v"), autoretried, state=KEY_HANDED) == ("transient", "autoretry_for")
    finally:
        app.conf.guardrails = {}


def test_celerys_autoretry_for_is_transient_errors_through_the_gate() -> None:
    # Given autoretry_for=(Exception,), dont_autoretry_for=(OSError,)
    # Then a listed error is transient, but only where a rerun is safe (this body marks nothing)
    assert verdict(RuntimeError("x"), autoretried, call={}, state=FRESH) == (
        "permanent",
        "autoretry_for:not_idempotent",
    )
    assert verdict(RuntimeError("x"), autoretried, state=KEY_HANDED) == ("transient", "autoretry_for")
    # dont_autoretry_for falls through to the other rules (an unknown error here, and the gate)
    assert verdict(FileNotFoundError(), autoretried, state=KEY_HANDED) == ("transient", "unknown_errors:auto")


def test_no_transport_failure_of_the_http_libraries_is_deterministic() -> None:
    # Given every exception class requests, httpx, urllib3, urllib and http.client define
    import http.client
    import inspect
    import urllib.error

    import httpx
    import requests.exceptions
    import urllib3.exceptions

    from celery_guardrails.runtime.classification import CONNECT_FAILURES, TRANSPORT_ERRORS

    classes = {
        klass
        for module in (requests.exceptions, httpx, urllib3.exceptions, urllib.error, http.client)
        for _, klass in inspect.getmembers(module, inspect.isclass)
        if issubclass(klass, BaseException) and klass.__module__.partition(".")[0] in ("requests", "httpx", "urllib3")
    }

    def rule_of(klass: type[BaseException]) -> str:
        error = klass.__new__(klass)  # no constructor arguments needed: classes are matched, not messages
        return classify(error, TaskOptions(task=marked), FRESH).rule

    transport = {k for k in classes if {c.__name__ for c in k.__mro__} & (TRANSPORT_ERRORS | CONNECT_FAILURES)}
    # Then none of their transport failures (no answer, a broken connection) is taken for a deterministic error
    assert len(transport) > 20
    assert sorted(k.__qualname__ for k in transport if rule_of(k) == "deterministic_errors") == []
    # And what is deterministic among them is bad input: a URL, a scheme, a header, a body that is not JSON
    deterministic = sorted(f"{k.__module__}.{k.__qualname__}" for k in classes if rule_of(k) == "deterministic_errors")
    assert deterministic == [
        "requests.exceptions.InvalidHeader",
        "requests.exceptions.InvalidProxyURL",
        "requests.exceptions.InvalidSchema",
        "requests.exceptions.InvalidURL",
        "requests.exceptions.JSONDecodeError",
        "requests.exceptions.MissingSchema",
        "requests.exceptions.StreamConsumedError",
        "urllib3.exceptions.LocationParseError",
        "urllib3.exceptions.LocationValueError",
        "urllib3.exceptions.ProxySchemeUnknown",
        "urllib3.exceptions.ProxySchemeUnsupported",
        "urllib3.exceptions.URLSchemeUnknown",
    ]


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
    # Given a keyed task that handed its key on, Then the status decides
    assert [verdict(error, keyed, state=KEY_HANDED) for error in errors] == [(kind, f"http:{status}")] * 3
    # Given a body that marks its effects, failing inside its first one, Then only a status saying the request
    # was not processed is retried: a 5xx may come after the provider acted
    if status in (408, 425, 429) or kind == "permanent":
        assert [verdict(error, marked) for error in errors] == [(kind, f"http:{status}")] * 3
    else:
        in_block = [Delivery(effects=1) for _ in errors]  # what the block's exit made of an ambiguous failure
        assert [verdict(e, marked, state=d) for e, d in zip(errors, in_block, strict=True)] == [
            ("permanent", f"http:{status}:not_idempotent")
        ] * 3
        assert [verdict(error, unsafe) for error in errors] == [(kind, f"http:{status}")] * 3
    # And a body that marks nothing is never retried on a transient status
    if kind == "transient":
        assert {verdict(error, plain)[0] for error in errors} == {"permanent"}


def test_retry_after_in_seconds_and_as_a_date(provider: str) -> None:
    import requests

    response = requests.get(f"{provider}/status/503?retry_after=7", timeout=5)
    with pytest.raises(requests.HTTPError) as caught:
        response.raise_for_status()
    assert classify(caught.value, TaskOptions(task=keyed), KEY_HANDED).retry_after == 7.0
    with pytest.raises(urllib.error.HTTPError) as by_urllib:
        urllib.request.urlopen(f"{provider}/status/429?retry_after=3", timeout=5)
    assert classify(by_urllib.value, TaskOptions(task=marked), FRESH).retry_after == 3.0
    when = datetime(2030, 1, 1, 12, 0, 10, tzinfo=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=(when - timedelta(seconds=10)).timestamp()) == 10.0
    assert parse_retry_after("yesterday-ish") is None


def test_a_refused_connection_is_retried_only_before_any_effect() -> None:
    # Given nothing listening (the discard port), When requests, httpx and urllib try to connect
    errors = failures_of("http://127.0.0.1:9")
    for error in errors:
        # Then nothing was sent: retried in a body that had done nothing yet
        assert sent_nothing(error), repr(error)
        assert classify(error, TaskOptions(task=marked), FRESH).kind is Kind.TRANSIENT, repr(error)
        # But not after an effect, nor in a body that marks nothing (anything may have happened before)
        assert classify(error, TaskOptions(task=marked), AFTER_EFFECT).kind is Kind.PERMANENT, repr(error)
        assert classify(error, TaskOptions(task=plain), FRESH).kind is Kind.PERMANENT, repr(error)
        assert classify(error, TaskOptions(task=keyed), KEY_UNREAD).kind is Kind.PERMANENT, repr(error)


def test_a_name_that_does_not_resolve_proves_nothing_was_sent() -> None:
    errors = failures_of("http://no-such-host.invalid/")
    for error in errors:
        assert sent_nothing(error), repr(error)
        assert classify(error, TaskOptions(task=marked), FRESH).kind is Kind.TRANSIENT, repr(error)


def test_a_read_timeout_is_ambiguous(provider: str) -> None:
    # Given a provider that received the request and answers too late (it may act on it meanwhile)
    errors = failures_of(f"{provider}/slow/2", read_timeout=0.3)
    for error in errors:
        # Then the request may have reached it: retried only where a rerun cannot act twice
        assert not sent_nothing(error), repr(error)
        assert classify(error, TaskOptions(task=plain), FRESH).rule.endswith(":not_idempotent")
        assert classify(error, TaskOptions(task=keyed), KEY_UNREAD).kind is Kind.PERMANENT, repr(error)
        assert classify(error, TaskOptions(task=keyed), KEY_HANDED).kind is Kind.TRANSIENT, repr(error)
        assert classify(error, TaskOptions(task=unsafe), FRESH).kind is Kind.TRANSIENT, repr(error)


def test_a_reset_after_sending_is_ambiguous(provider: str) -> None:
    errors = failures_of(f"{provider}/reset")
    for error in errors:
        assert not sent_nothing(error), repr(error)
        assert classify(error, TaskOptions(task=plain), FRESH).kind is Kind.PERMANENT, repr(error)
        assert classify(error, TaskOptions(task=keyed), KEY_HANDED).kind is Kind.TRANSIENT, repr(error)


def test_transient_errors_pass_the_gate_only_where_a_rerun_is_safe() -> None:
    # Given transient_errors=(ConnectionError, TimeoutError) on a body that marks its effects
    # Then before its first effect they are retried; after one, not
    assert verdict(ConnectionResetError(), marked_with_transient_errors) == ("transient", "transient_errors")
    assert verdict(TimeoutError(), marked_with_transient_errors, state=AFTER_EFFECT) == (
        "permanent",
        "transient_errors:not_idempotent",
    )
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
        from celery_guardrails.options import TaskOptions
        from celery_guardrails.runtime.classification import classify
        app = Celery("x", set_as_current=False)
        def body(self):
            pass
        task = app.task(base=GuardedTask, bind=True)(body)
        classify(RuntimeError("boom"), TaskOptions(task=task))
        print(sorted(m for m in ("requests", "httpx", "urllib3") if m in sys.modules))
    """),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
