"""Effects, marked: what a body's ``effect()`` blocks count, what its code is seen to mark, the opaque key."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

import celery_guardrails
from celery_guardrails import GuardedTask, effect
from celery_guardrails import effect as mark
from celery_guardrails.options import TaskOptions
from celery_guardrails.runtime.delivery import delivery
from celery_guardrails.runtime.effects import marks_effects, provider_key, reads_key
from tests.support.services import REDIS_URL, require

app = Celery("effects", set_as_current=False)
app.conf.update(broker_url="memory://", task_always_eager=False, result_backend=None)
app.conf.guardrails = {"store": REDIS_URL, "dead_letter_sinks": ["redis"], "activity": False}


def _charges_in_a_helper(task: GuardedTask) -> None:
    with task.effect():
        pass


def _helper_of_a_helper(task: GuardedTask) -> None:
    _charges_in_a_helper(task)


@app.task(base=GuardedTask, bind=True)
def with_self_effect(self: GuardedTask) -> None:
    with self.effect():
        pass


@app.task(base=GuardedTask, bind=True)
def with_module_effect(self: GuardedTask) -> None:
    with celery_guardrails.effect():
        pass


@app.task(base=GuardedTask, bind=True)
def with_imported_effect(self: GuardedTask) -> None:
    with effect():
        pass


@app.task(base=GuardedTask, bind=True)
def with_renamed_effect(self: GuardedTask) -> None:
    with mark():
        pass


@app.task(base=GuardedTask, bind=True)
def in_a_nested_function(self: GuardedTask) -> None:
    def send() -> None:
        with self.effect():
            pass

    send()


@app.task(base=GuardedTask, bind=True)
def in_a_helper(self: GuardedTask) -> None:
    _helper_of_a_helper(self)


@app.task(base=GuardedTask, bind=True)
def marks_nothing(self: GuardedTask, side_effect: Any = None) -> None:
    side_effect = {"effect": 1}  # a local named like it, a dict key: not a mark
    print(side_effect["effect"])


@app.task(base=GuardedTask, bind=True, marks_effects=True)
def declared_marking(self: GuardedTask) -> None: ...


@app.task(base=GuardedTask, bind=True, marks_effects=False)
def declared_not_marking(self: GuardedTask) -> None:
    with self.effect():
        pass


@app.task(base=GuardedTask, bind=True, idempotency_key="k:{n}")
def hands_its_key(self: GuardedTask, n: int) -> str | None:
    return self.request.idempotency_key


class ClassBased(GuardedTask):
    name = "tests.effects.class_based"

    def run(self) -> None:
        with self.effect():
            pass


class_based = app.register_task(ClassBased())


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        (with_self_effect, True),
        (with_module_effect, True),
        (with_imported_effect, True),
        (with_renamed_effect, True),
        (in_a_nested_function, True),
        (in_a_helper, True),
        (class_based, True),
        (marks_nothing, False),
        (declared_marking, True),
        (declared_not_marking, False),
    ],
)
def test_whether_a_body_marks_its_effects_is_read_from_its_code(task: Any, expected: bool) -> None:
    # Given a task function, When the gate asks whether it marks its effects, Then its own code (and the
    # module functions it calls) says so, unless the task declares it (marks_effects)
    assert marks_effects(TaskOptions(task=task)) is expected


def test_whether_a_body_reads_its_key_is_read_from_its_code() -> None:
    assert reads_key(hands_its_key) is True
    assert reads_key(with_self_effect) is False


@app.task(base=GuardedTask, bind=True)
def counts(self: GuardedTask, steps: list[str]) -> list[int]:
    """Each step is one effect block: ``ok``, or an error caught after the block (the body goes on)."""
    errors = {"refused": ConnectionRefusedError, "reset": ConnectionResetError, "timeout": TimeoutError}
    seen = []
    for step in steps:
        try:
            with self.effect():
                if step in errors:
                    raise errors[step]()
        except OSError:
            pass
        seen.append(delivery(self).effects)
    return seen


def test_each_block_counts_unless_its_error_proves_nothing_was_sent() -> None:
    require("redis")
    # Given a body whose blocks end done, refused, reset, timed out, done
    result = counts.apply((["refused", "ok", "refused", "reset", "timeout"],)).get()
    # Then a refusal counts nothing; a block done, or ended in an error after sending may have acted, counts one
    assert result == [0, 1, 1, 2, 3]


@effect()
def _book(task: GuardedTask) -> None:
    """A helper marked as an effect by its decorator (one block per call)."""


@app.task(base=GuardedTask, bind=True, marks_effects=True)
def books_twice(self: GuardedTask) -> int:
    _book(self)
    _book(self)
    return delivery(self).effects


def test_an_effect_decorator_counts_each_call() -> None:
    require("redis")
    # Given a helper decorated with effect(), When a body calls it twice, Then each call is one block
    assert books_twice.apply().get() == 2


def test_outside_a_guarded_body_an_effect_block_does_nothing() -> None:
    # Given no task running, When code marks an effect (a helper called from a script, a test)
    with effect():
        pass

    @effect()
    def decorated() -> str:
        return "ran"

    # Then it simply runs
    assert decorated() == "ran"


def test_the_key_a_body_is_handed_is_opaque_and_stable() -> None:
    require("redis")
    # Given a keyed task, When its body reads self.request.idempotency_key
    n = uuid.uuid4().int % 10**9  # a key of this run's own (a completed key is kept for days)
    handed = hands_its_key.apply((n,)).get()
    # Then it is a UUID made from the scoped key: the same for every run, telling nothing of module or tenant
    assert handed == provider_key(f"tests.celery_guardrails.runtime.test_effects.hands_its_key:-:k:{n}")
    assert str(uuid.UUID(str(handed))) == handed and "test_effects" not in str(handed)
    assert provider_key("t:acme:k:7") != provider_key("t:globex:k:7")
