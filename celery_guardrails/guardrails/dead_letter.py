"""Dead letters that could not be recorded yet: the message came back carrying them; record them now.

When no sink could record a final failure (the database was down), :func:`~celery_guardrails.outcomes.
fail_finally` published the message again with the pending record in its header instead of acking it away.
This guardrail, early in ``before_run``, records it (the body never runs again) and fails the task with
:class:`~celery_guardrails.exceptions.DeadLetteredError`; if the sinks are still down, the message goes
round again, waiting twice as long each time (at most 10 minutes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_guardrails import headers
from celery_guardrails.exceptions import DeadLetteredError
from celery_guardrails.outcomes import PENDING_DEAD_LETTER, FinalFailure, hand_over
from celery_guardrails.pipeline import Guardrail

if TYPE_CHECKING:
    from celery_guardrails.task import GuardedTask


class PendingDeadLetters(Guardrail):
    def before_run(self, task: GuardedTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pending = headers.from_request(task.request).get(PENDING_DEAD_LETTER)
        if not isinstance(pending, dict):
            return
        # The record is this message's, whatever ids the header carries (a header another producer wrote could
        # otherwise write a dead letter for any task id).
        failure = FinalFailure.from_dict({**pending, "task_id": task.request.id, "task_name": task.name})
        error = DeadLetteredError(failure.reason, failure.exc_type, failure.exc_message)
        again = hand_over(task, failure, error)
        raise again or error
