"""The test kit's assertions: one effect, a dead letter with its reason, nothing lost, a job in its state.

Each fails with an ``AssertionError`` that says what the kit's worker did with the messages concerned (a job:
its history).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from celery_guardrails.testing import events
from celery_guardrails.testing.current import current_kit, running_kit

if TYPE_CHECKING:
    from celery_guardrails.testing.kit import Kit

#: Outcomes of a delivery whose message was handled (run, or found done before).
HANDLED = frozenset({"succeeded", "skipped", "duplicate_skipped"})


def _count(effect: Any) -> int:
    if callable(effect):
        effect = effect()
    counter = getattr(effect, "count", None)
    if callable(counter) and not isinstance(effect, list | tuple | str):
        effect = counter()  # a Django QuerySet
    elif isinstance(effect, list | tuple | set | dict):
        effect = len(effect)
    return int(effect)


def assert_single_effect(effect: Any, *, expected: int = 1, kit: Kit | None = None, what: str = "the effect") -> int:
    """``effect`` happened exactly ``expected`` times (default once).

    ``effect``: a number, a callable that returns one, a Django QuerySet (counted), or a collection (its
    length), read once the kit's deliveries have ended. Returns the count."""
    found = _count(effect)
    if found != expected:
        kit = kit or running_kit()
        told = f"\n{kit.describe()}" if kit is not None else ""
        raise AssertionError(f"{what} happened {found} times, expected {expected}{told}")
    return found


def dead_letter_of(app: Any, task_id: str) -> dict[str, Any] | None:
    """The dead letter of ``task_id`` in ``app``'s sinks (the Django table, or the Redis stream), or None."""
    from celery_guardrails.runtime.dead_letters import sinks_for

    for sink in sinks_for(app):  # the sinks the workers record to, as they resolve them
        found = sink.find(task_id)
        if found is not None:
            return found
    return None


def assert_dead_lettered(
    task_id: str, *, reason: str | None = None, kit: Kit | None = None, app: Any = None
) -> dict[str, Any]:
    """A dead letter of ``task_id`` was recorded (with ``reason``, when given); returns the record."""
    kit = kit or current_kit()
    record = dead_letter_of(app or kit.celery_app, task_id)
    if record is None:
        raise AssertionError(f"no dead letter for {task_id}\n{kit.describe()}")
    if reason is not None and record.get("reason") != reason:
        raise AssertionError(f"the dead letter of {task_id} gives the reason {record.get('reason')!r}, not {reason!r}")
    return record


def assert_no_loss(*task_ids: str, kit: Kit | None = None) -> dict[str, str]:
    """Every message the kit sent (or each of ``task_ids``) was handled, or recorded as a dead letter.

    Lost: a message whose deliveries all ended without it running (a failure Celery acked with nothing
    recorded, a message refused and dropped), or that never ended at all. Returns task id -> how it ended
    (``handled`` or ``dead_lettered``)."""
    kit = kit or current_kit()
    wanted = list(task_ids) or list(kit.sent)
    found = kit.messages()
    verdicts: dict[str, str] = {}
    lost: list[str] = []
    for task_id in wanted:
        message = found.get(task_id, events.Message(task_id))
        outcomes = {outcome for outcome, _ in message.outcomes}
        if outcomes & HANDLED:
            verdicts[task_id] = "handled"
        elif dead_letter_of(kit.celery_app, task_id) is not None:
            verdicts[task_id] = "dead_lettered"
        else:
            ended = ", ".join(outcome for outcome, _ in message.outcomes) or "never ended"
            lost.append(f"  {message.task_name or '?'}[{task_id}]: {ended}, no dead letter")
    if lost:
        raise AssertionError(f"{len(lost)} message(s) lost:\n" + "\n".join(lost) + f"\n{kit.describe()}")
    return verdicts


#: Seconds :func:`assert_job` waits by default, and between two reads of the job.
JOB_TIMEOUT = 30.0
JOB_POLL = 0.05


def _job_history(view: Any) -> str:
    from celery_guardrails.operations.job_text import moment, shown

    lines = [
        f"  {moment(str(entry.get('at') or ''))}  {shown(entry.get('state', ''))}  attempt {entry.get('attempt', '?')}"
        + (f"  {shown(entry['detail'])}" if entry.get("detail") else "")
        for entry in view.history
    ]
    error = f"\n  error: {shown(view.error)}" if view.error else ""
    letter = f"\n  dead letter: {shown(view.dead_letter_task_id)}" if view.dead_letter_task_id else ""
    return "\n".join(lines) + error + letter


def assert_job(job: Any, *, state: str, timeout: float = JOB_TIMEOUT) -> Any:
    """Wait until the job ``job`` (a ``Job`` as ``task.submit()`` returns it, or its id) is in ``state``, and
    return how the job book reads it then (a :class:`~celery_guardrails.guardrails.jobs.JobView`); a ``Job``
    given is refreshed too (``refresh_from_db``).

    Read through the registered job book (the Django app's), so from the test's own database connection: with
    pytest-django, a worker sees the test's rows only under ``django_db(transaction=True)``. Fails with an
    ``AssertionError`` that shows the job's history when ``timeout`` seconds pass first, at once when the job
    reached another final state (only a replay moves it on from there: assert after the replay returns), and
    when there is no such job. ``state`` is one of :data:`~celery_guardrails.guardrails.jobs.STATES`."""
    from celery_guardrails.guardrails.jobs import STATES, TERMINAL, registered_book

    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r:.80}")
    book = registered_book()
    if book is None:
        raise AssertionError("no job book is registered: add 'django_celery_guardrails' to INSTALLED_APPS")
    job_id = str(getattr(job, "id", job))
    deadline = time.monotonic() + timeout
    while True:
        view = book.describe(job_id)
        if view is None:
            raise AssertionError(f"no job {job_id}")
        if view.state == state:
            break
        if view.state in TERMINAL:
            raise AssertionError(
                f"job {job_id} ({view.task_name}) ended {view.state}, not {state}:\n{_job_history(view)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} ({view.task_name}) is {view.state}, not {state}, after {timeout:g}s:\n"
                f"{_job_history(view)}"
            )
        time.sleep(JOB_POLL)
    refresh = getattr(job, "refresh_from_db", None)
    if callable(refresh):
        refresh()
    return view
