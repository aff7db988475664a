"""What a guarded task's result backend keeps of a failure: redacted, of the same type when it can be rebuilt
(the worker's whole path: tests/celery_guardrails/foundation/test_secrets.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis

from celery_guardrails.foundation.redaction import DEFAULT
from celery_guardrails.runtime.results import RedactingBackend, redacted_exception
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
