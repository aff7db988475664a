"""A guarded task's request stack on threading.local (celery_guardrails.runtime.request_stack): Celery's LocalStack
behaviour, each thread its own stack."""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery

from celery_guardrails import GuardedTask
from celery_guardrails.runtime.request_stack import RequestStack


def test_a_guarded_task_reads_its_requests_from_a_request_stack_and_a_plain_one_does_not() -> None:
    app = Celery("request-stack")

    @app.task(base=GuardedTask, bind=True)
    def guarded(self: Any) -> str:
        return str(self.request.id)

    @app.task
    def plain() -> None: ...

    assert type(app.tasks[guarded.name].request_stack) is RequestStack
    assert type(app.tasks[plain.name].request_stack) is not RequestStack
    # and a body sees its own request, also when another run of it is nested inside
    assert guarded.apply(task_id="outer").get() == "outer"


def test_pushes_and_pops_nest_and_each_thread_sees_only_its_own() -> None:
    stack = RequestStack()
    # Given an empty stack: no top, nothing to pop
    assert stack.top is None and stack.pop() is None and len(stack) == 0 and stack.stack == []
    # When two requests are pushed, the last is on top, and pops give them back in turn
    stack.push("outer")
    stack.push("inner")
    assert (stack.top, len(stack), stack.stack) == ("inner", 2, ["outer", "inner"])
    seen: list[Any] = []
    other = threading.Thread(target=lambda: seen.extend([stack.top, len(stack), stack.push("theirs"), stack.top]))
    other.start()
    other.join()
    # (another thread saw an empty stack, and its push is its own)
    assert seen == [None, 0, ["theirs"], "theirs"]
    assert stack.pop() == "inner" and stack.top == "outer"
    stack.__release_local__()
    assert stack.top is None
