"""What a guarded task's result backend keeps of a failure: redacted, of the same type when it can be rebuilt
(the worker's whole path: tests/celery_guardrails/foundation/test_secrets.py); and a success whose completion
rides the ack, left to the script that acks it (the worker's whole path:
tests/celery_guardrails/guardrails/test_acks.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery.app.task import Context

from celery_guardrails.foundation.redaction import DEFAULT
from celery_guardrails.runtime.delivery import ATTRIBUTE, Delivery, RidingCompletion, RidingResult
from celery_guardrails.runtime.results import RedactingBackend, prepared_result, redacted_exception
from celery_guardrails.stores.base import BrokerAck
from tests.proj import leaky
from tests.support import planted
from tests.support.planted import leaked
from tests.support.services import REDIS_URL


class Strict(Exception):
    def __new__(cls, *args: Any, code: int) -> Strict:  # made only with its code
        return super().__new__(cls, *args)

    def __init__(self, *args: Any, code: int) -> None:
        super().__init__(*args)
        self.code = code


class Described(Exception):
    def __init__(self, response: Any) -> None:
        super().__init__("request failed")
        self.response = response  # an object: dropped

    def __str__(self) -> str:
        return f"request failed: {self.response.text}"


class Response:
    text = planted.MESSAGE


@pytest.mark.parametrize(
    ("exc", "kept_as"),
    [
        (ValueError(planted.MESSAGE, 3), ValueError),
        (FileNotFoundError(2, "no such file", planted.PG_URL), FileNotFoundError),
        (leaky.ProviderError(500, planted.HTTPS_URL), leaky.ProviderError),
        (
            Strict(planted.MESSAGE, code=1),
            Exception,
        ),  # its __new__ refuses the redacted arguments: a plain Exception naming it
        (Described(Response()), Exception),  # its str needs an attribute that is not kept
    ],
)
def test_an_exception_is_kept_redacted_of_its_own_type_where_it_can_be_rebuilt(exc: Any, kept_as: type) -> None:
    kept = redacted_exception(exc, DEFAULT)
    assert type(kept) is kept_as and kept is not exc
    assert leaked(str(kept)) == [] and leaked(repr(kept)) == [] and leaked(kept.args) == []
    if kept_as is Exception:
        assert str(kept).startswith(f"{type(exc).__module__}.{type(exc).__qualname__}: ")


def test_the_option_off_stores_the_failure_as_raised(celery_app: Any) -> None:
    # Given a guarded task whose app turns redact_results off, and one that keeps the default
    def stored(task_id: str) -> dict[str, Any]:
        return dict(json.loads(redis.Redis.from_url(REDIS_URL).get(f"celery-task-meta-{task_id}") or b"{}"))

    task = celery_app.tasks[leaky.leak.name]
    assert isinstance(task.backend, RedactingBackend)
    redacted, raw = str(uuid.uuid4()), str(uuid.uuid4())
    task.backend.mark_as_failure(redacted, leaky.LeakyError(planted.MESSAGE), traceback=planted.MESSAGE)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "redact_results": False}
    task.backend.mark_as_failure(raw, leaky.LeakyError(planted.MESSAGE), traceback=planted.MESSAGE)
    # Then the first is stored redacted, the second as raised
    assert leaked(stored(redacted)) == []
    assert leaked(stored(raw)) == list(planted.SECRETS)
    # And everything else a backend does passes through to the app's own
    assert task.backend.get_key_for_task(raw) == celery_app.backend.get_key_for_task(raw)
    assert celery_app.AsyncResult(raw, backend=task.backend).state == "FAILURE"
    redis.Redis.from_url(REDIS_URL).delete(*(f"celery-task-meta-{task_id}" for task_id in (raw, redacted)))


def riding_delivery(task_id: str, result: RidingResult | None = None) -> Context:
    """A request whose delivery's completion rides the ack (celery_guardrails.guardrails.acks), with ``result``."""
    request = Context(id=task_id, ignore_result=False)
    riding = RidingCompletion(
        key="k",
        owner="o",
        summary="",
        retention=60,
        settle=lambda exc: None,
        lost=lambda: None,
        ack=BrokerAck(unacked="unacked", index="unacked_index", tag=task_id),
        result=result,
    )
    setattr(request, ATTRIBUTE, Delivery(riding=riding))
    return request


def test_a_result_is_prepared_as_celery_would_store_it_and_left_to_the_script(celery_app: Any) -> None:
    # Given a guarded task on a Redis result backend, and a delivery whose completion rides the ack with its result,
    # encoded as the body returned
    task = celery_app.tasks[leaky.leak.name]
    backend, client = celery_app.backend, redis.Redis.from_url(REDIS_URL)
    task_id = str(uuid.uuid4())
    prepared = prepared_result(backend, task_id, {"n": 1}, Context(id=task_id, ignore_result=False))
    assert prepared is not None
    key = backend.get_key_for_task(task_id).decode()
    assert (prepared.write.key, prepared.write.expires) == (key, backend.expires)
    meta = backend.decode_result(prepared.write.value)
    assert (meta["status"], meta["result"], meta["task_id"]) == ("SUCCESS", {"n": 1}, task_id)
    request = riding_delivery(task_id, prepared)
    # When Celery marks it done
    task.backend.mark_as_done(task_id, {"n": 1}, request)
    # Then nothing is stored by Celery: the script that completes the key and acks the message writes it
    assert client.get(key) is None
    assert getattr(request, ATTRIBUTE).riding.result is prepared
    # And Celery's own store of it (when the ack cannot carry it) stores the same result
    prepared.store()
    assert backend.get_task_meta(task_id)["result"] == {"n": 1}
    client.delete(key)


def test_a_result_celery_would_not_store_rides_no_more(celery_app: Any) -> None:
    # Given a delivery whose completion rides the ack with its result
    task, backend = celery_app.tasks[leaky.leak.name], celery_app.backend
    task_id = str(uuid.uuid4())
    request = riding_delivery(task_id, prepared_result(backend, task_id, 1, Context(id=task_id)))
    # When Celery marks it done without storing it (the message asked for no result)
    task.backend.mark_as_done(task_id, 1, request, False)
    # Then the script has no result to write, and none is stored
    assert getattr(request, ATTRIBUTE).riding.result is None
    assert backend.get_task_meta(task_id)["status"] == "PENDING"


def test_a_result_that_cannot_be_encoded_is_not_prepared(celery_app: Any) -> None:
    # (the completion is then made as the body returns, and Celery's mark_as_done fails the task as it does)
    assert prepared_result(celery_app.backend, "t", object(), Context(id="t")) is None


@pytest.mark.parametrize(
    "request_of",
    [
        lambda task_id: riding_delivery(task_id),  # rides the ack without its result (not stored on the store's Redis)
        lambda task_id: Context(id=task_id, ignore_result=False),  # no completion rides the ack
    ],
    ids=["rides without its result", "not riding"],
)
def test_a_success_whose_result_does_not_ride_is_stored_by_celery_at_once(celery_app: Any, request_of: Any) -> None:
    task = celery_app.tasks[leaky.leak.name]
    task_id = str(uuid.uuid4())
    task.backend.mark_as_done(task_id, "done", request_of(task_id))
    assert celery_app.backend.get_task_meta(task_id)["result"] == "done"
    redis.Redis.from_url(REDIS_URL).delete(celery_app.backend.get_key_for_task(task_id))
