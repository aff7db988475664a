"""Pending dead letters carried in a message's header (``guardrails.dl``) from another producer, on a real worker
with the Redis stream sink: whatever the header claims, the record is the message's own, its tenant, owner,
reason and history checked, its text cut and redacted; a forged one still ends in exactly one record, and the
task's body never runs."""

from __future__ import annotations

from typing import Any

import pytest

from celery_guardrails.runtime import headers
from tests.conftest import Sink
from tests.support.dead_letters import dead_letter_of
from tests.support.waiting import wait_for

TASK = "tests.proj.tasks.charge"
ORDER = 7
#: The scoped key the messages make (charge's idempotency_key "charge:{order_id}", tenant acme).
KEY = f"{TASK}:acme:charge:{ORDER}"
RECORD = {"n": 1, "start": "2026-11-30T08:00:00.000+00:00", "end": "2026-11-30T08:00:01.000+00:00", "host": "w1"}


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    # kombu's own pop: the atomic pop's script (Redis's cjson) cannot read a lone surrogate, and sets such a
    # message aside before any worker sees it (celery_guardrails.broker.atomic_pop); here the worker must see it.
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "owners": {"tests.proj.tasks.*": "payments"},
        "broker_atomic_pop": False,
    }
    return celery_app


def pending(**fields: Any) -> dict[str, Any]:
    """A pending dead letter as fail_finally writes it (FinalFailure.to_dict()), with ``fields`` changed."""
    return {
        "task_name": TASK,
        "task_id": "the-id-it-was-written-for",
        "reason": "permanent",
        "exc_type": "celery_guardrails.exceptions.PermanentError",
        "exc_message": "card refused",
        "tenant": "acme",
        "correlation_id": "req-pending-1",
        "attempts": 1,
        "history": [{**RECORD, "exc": "PermanentError", "msg": "card refused", "class": "permanent", "delay": None}],
        "args": [ORDER],
        "kwargs": {},
        "queue": "celery",
        "owner": "payments",
        "idempotency_key": KEY,
        "header": {"tenant": "acme"},
        "traceback": "Traceback (most recent call last): ...",
        "first_failed_at": "2026-11-30T08:00:00.000+00:00",
        "last_failed_at": "2026-11-30T08:00:01.000+00:00",
        **fields,
    }


#: name -> the pending dead letter another producer put in the header of a message of tenant acme.
FORGED: dict[str, Any] = {
    "genuine": pending(owner="someone-else", task_id="another-task", task_name="tests.proj.tasks.other"),
    "bad tenant": pending(tenant="acme corp!"),
    "other tenant": pending(tenant="globex"),
    "no tenant": pending(tenant=None),
    "unknown reason": pending(reason="pwned\u202egnp.exe"),
    "history not a list": pending(history="[]"),
    "history of wrong types": pending(history=[{**RECORD, "n": "one", "msg": 5, "delay": "x", "deep": {"x": [1]}}]),
    "history of a megabyte": pending(history=[{**RECORD, "msg": "m" * 20_000, "note": "n" * 20_000}] * 30),
    "a megabyte message": pending(exc_message="x" * 1_000_000, traceback="t" * 100_000, exc_type="E" * 1_000),
    "NUL, surrogates, a secret": pending(
        exc_message="bad\x00byte \udc80 password=hunter2", history=[{**RECORD, "msg": "token=tok-live-9 \x00"}]
    ),
    "another tenant's key": pending(idempotency_key=f"{TASK}:globex:charge:{ORDER}"),
    "huge attempts": pending(attempts=10**30),
    "not a mapping": "pending",
    "required fields missing": {"reason": "permanent", "tenant": "acme"},
}


def test_forged_pending_dead_letters_each_end_in_one_checked_record(
    celery_app: Any, celery_worker: Any, sink: Sink
) -> None:
    # Given messages of tenant acme, sent by name as another producer would, each carrying a pending dead letter
    sent = {
        name: celery_app.send_task(TASK, (ORDER, sink.key), headers={"guardrails": {"tenant": "acme", "dl": dl}})
        for name, dl in FORGED.items()
    }
    # When the worker takes them all
    wait_for("every message handled", lambda: all(result.ready() for result in sent.values()))
    records = {name: dead_letter_of(celery_app, result.id) for name, result in sent.items()}
    # Then each failed, the body never ran (it counts its runs), and each is one record of its own message
    assert all(result.state == "FAILURE" for result in sent.values())
    assert sink.client.get(f"{sink.key}:runs") is None
    for name, record in records.items():
        assert (record["task_id"], record["task_name"]) == (sent[name].id, TASK), name
        # the tenant is the message's, the owner the task's (never the header's)
        assert (record["tenant"], record["owner"]) == ("acme", "payments"), name
        assert record["args"] == [ORDER, sink.key] and "dl" not in record["header"], name
        assert len(record["exc_message"]) <= 700 and len(record["traceback"]) <= 20_000, name
        assert "hunter2" not in str(record) and "tok-live-9" not in str(record), name

    # A genuine one keeps its reason, message, history and key
    genuine = records.pop("genuine")
    assert (genuine["reason"], genuine["exc_message"]) == ("permanent", "card refused")
    assert genuine["idempotency_key"] == KEY and genuine["correlation_id"] == "req-pending-1"
    assert [r["msg"] for r in genuine["history"]] == ["card refused"]
    # So do those whose fields were only cut or cleaned
    for name in ("history of wrong types", "history of a megabyte", "a megabyte message", "NUL, surrogates, a secret"):
        assert records[name]["reason"] == "permanent", name
    # (a field of the wrong type is left out, a value no attempt record holds too)
    assert records["history of wrong types"]["history"] == [{k: v for k, v in RECORD.items() if k != "n"}]
    megabyte = records["history of a megabyte"]["history"]
    assert len(megabyte) == headers.HISTORY_LIMIT and all(len(r["msg"]) == headers.MESSAGE_LIMIT for r in megabyte)
    assert records["a megabyte message"]["exc_message"] == "x" * headers.MESSAGE_LIMIT
    assert records["a megabyte message"]["exc_type"] == "E" * 255
    nul = records["NUL, surrogates, a secret"]
    assert nul["exc_message"] == "bad\\x00byte \\udc80 password=[redacted]"
    assert nul["history"][0]["msg"] == "token=[redacted] \\x00"

    # The others are malformed_message, saying what was wrong, the claim shown escaped
    said = {
        "bad tenant": "its tenant 'acme corp!' is not a valid tenant id",
        "other tenant": "its tenant 'globex' is not the message's ('acme')",
        "no tenant": "its tenant None is not the message's ('acme')",
        "unknown reason": "its reason 'pwned\\u202egnp.exe' is not one a dead letter can give",
        "history not a list": "its history is not a list of attempt records",
        "another tenant's key": "its idempotency key is not the one the message makes",
        "not a mapping": "the pending dead letter is a str, not a mapping",
        "required fields missing": "it lacks task_name, task_id, exc_type, exc_message (or they are not text)",
    }
    for name, text in said.items():
        record = records[name]
        assert record["reason"] == "malformed_message", name
        assert record["exc_message"].startswith(f"[malformed pending dead letter: {text}"), (
            name,
            record["exc_message"],
        )
    assert records["another tenant's key"]["idempotency_key"] == ""
    assert records["huge attempts"]["attempts"] == 1
    assert "\u202e" not in str(records["unknown reason"])
