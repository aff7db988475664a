"""Jobs a user can poll: the state of a submitted job follows its message through every path.

``task.submit(...)`` (or ``apply_async(..., job=True)``) writes a job record in the caller's database transaction
and sends the message carrying the job's id in its header (``job``, :mod:`celery_guardrails.runtime.headers`).
This guardrail and the receivers below write the job's state as the message runs; the record itself lives where
the registered :class:`JobBook` keeps it (the Django app registers one as it is ready; the core keeps none).

The states and what writes them:

* ``queued``: written with the record; again when a dead letter of it is replayed (the same job), and as a
  delivery finds its own earlier run still ``running`` (its worker died mid-body: the history shows ``queued``,
  "worker lost", then ``running`` again).
* ``running``: :meth:`JobTracking.before_run`, when every other guardrail agreed to run the body (it is placed
  after them), so a delivery that is deferred or refused never reads as running.
* ``retrying``: a classified retry was scheduled (``retry_scheduled``, kind ``transient``).
* ``waiting``: a wait that spends no attempt: ``RetryLater``, a record not there yet, a busy key, a concurrency
  slot, an ordering turn (``retry_scheduled``, kind ``retry_later``), a retry budget or open circuit
  (``retry_deferred``), the store out of reach (``store_unavailable``).
* ``succeeded``: for an ``atomic`` task, in the transaction that commits the body's effect and its idempotency
  key (:meth:`JobTracking.body_context`, inside the Idempotency guardrail's); otherwise in ``on_success``, after
  the body returned and its key was completed. A duplicate of a completed key succeeds as one.
* ``dead_lettered``: a final failure was recorded (``final_failure``, sent once its dead letter is durable),
  on the worker or in its main process (a hard time limit).
* ``failed``: the task failed with no dead letter recorded (a stale ordered message, a key that failed before).
* ``cancelled``: ``job.cancel()`` before it started; a delivery of a cancelled job does not run its body.

Terminal states (``succeeded``, ``failed``, ``dead_lettered``, ``cancelled``) are final: only a replay moves a job
out of ``failed`` or ``dead_lettered``, back to ``queued``. A job's state is a view of its work, never a reason to
refuse it: a write that fails is logged as one warning with the ids, and the delivery goes on (except the
``atomic`` success, which commits with the effect or not at all). The body reports progress with
``self.job.progress(done, total)``, written at most once every ``job_progress_interval`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from celery_guardrails import signals
from celery_guardrails.options import APP, TASK, Option, checks, declare
from celery_guardrails.runtime import headers
from celery_guardrails.runtime.delivery import delivery, view
from celery_guardrails.runtime.outcomes import kept_text
from celery_guardrails.runtime.pipeline import Guardrail, SkipBody, Task

logger = logging.getLogger(__name__)

QUEUED, RUNNING, RETRYING, WAITING = "queued", "running", "retrying", "waiting"
SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED = "succeeded", "failed", "dead_lettered", "cancelled"
#: Every state, in the order a job usually passes them.
STATES = (QUEUED, RUNNING, RETRYING, WAITING, SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED)
#: States a job does not leave (but for a replay of a failed or dead-lettered one).
TERMINAL = frozenset({SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED})
#: Characters of an error summary kept on a job (redacted with the task's settings).
ERROR_LIMIT = 300

DECLARED = declare(
    Option(
        name="job_progress_interval",
        default=1.0,
        doc="Seconds between two progress writes of a job (self.job.progress(done, total)); a progress that "
        "reaches its total is written at once.",
        check=checks.seconds,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="job_outbox",
        default=True,
        doc="submit() writes the job's message through the transactional outbox, in the caller's transaction "
        "with the job record, and the relay publishes it once committed (nothing is lost between the commit "
        "and the publish). False: published on commit (transaction.on_commit), as delay_on_commit does: a crash "
        "in between leaves the job queued with no message.",
        check=checks.boolean,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="job_retention",
        default=30 * 24 * 3600.0,
        doc="Seconds a job in a final state (succeeded, failed, dead_lettered, cancelled) is kept after it "
        "finished (30 days); the prune (guardrails_prune) deletes older ones. Jobs not finished are never pruned.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobStart:
    """What the job book answered as a delivery of a job starts: whether the body may run (a cancelled job's
    may not), and the state the job was in."""

    run: bool
    was: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JobMove:
    """One change of a job's state, as the worker reports it to the job book."""

    job_id: str
    #: The message's task id (a replay gives the job a new one).
    task_id: str
    state: str
    #: The attempt the delivery made (0: none was made yet).
    attempt: int = 0
    #: Why: the wait's reason, the dead letter's reason, "worker lost", "duplicate", "replayed".
    detail: str = ""
    #: A short error summary (``ExceptionClass: message``), redacted and cut to ERROR_LIMIT characters.
    error: str = ""
    #: The task id of the dead letter recorded for it ("" when none).
    dead_letter: str = ""
    #: When a waiting or retrying job is due to run again (epoch seconds; None: not known).
    due: float | None = None
    #: The delivery ran the body (a wait before it did not: a job still ``running`` under the same message was
    #: left so by a worker that died).
    ran: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """A job as the job book reads it back, for operators and tests (``celery -A proj guardrails job <id>``,
    :func:`celery_guardrails.testing.assert_job`): no arguments, no output, only where the job is."""

    id: str
    task_name: str
    task_id: str
    tenant: str
    state: str
    attempt: int
    detail: str
    progress_done: int | None
    progress_total: int | None
    output_ref: str
    error: str
    #: The task id of its dead letter ("" when none).
    dead_letter_task_id: str
    #: Moments as ISO-8601 text (None: not yet).
    created_at: str
    started_at: str | None
    finished_at: str | None
    due_at: str | None
    cancel_requested_at: str | None
    #: Its transitions, oldest first: {state, at, attempt, detail}.
    history: tuple[dict[str, Any], ...]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCount:
    """Jobs of one task in one state (the metrics' gauge, read at scrape time)."""

    task: str
    state: str
    jobs: int


class JobBook(Protocol):
    """Where job records live (the Django app's is :class:`django_celery_guardrails.jobs.DjangoJobBook`)."""

    def submit(self, task: Any, args: Any, kwargs: Any, *, task_id: str | None, options: dict[str, Any]) -> Any:
        """Write the job record of ``task``'s message in the caller's transaction, and its message to go out
        once that commits (``options`` are ``apply_async``'s); the job."""
        ...

    def started(self, *, job_id: str, task_id: str, attempt: int, requeued: str) -> JobStart:
        """A delivery of the job is about to run its body: mark it ``running`` (after ``queued`` with
        ``requeued`` as the detail when the same message left it running: its worker died, or its time limit
        killed it); ``run=False`` for a cancelled job or one whose run already ended."""
        ...

    def moved(self, move: JobMove) -> bool:
        """Write ``move`` unless the job is terminal (a replay's ``queued`` leaves ``failed`` or
        ``dead_lettered``); whether it was written."""
        ...

    def progress(self, *, job_id: str, done: int, total: int | None) -> None:
        """Record the body's progress."""
        ...

    def describe(self, job_id: str) -> JobView | None:
        """The job ``job_id`` as it is now; None when there is none (or the id is not one)."""
        ...

    def counts(self) -> list[JobCount]:
        """How many jobs each task has in each state (kept jobs: terminal ones until they are pruned)."""
        ...


_BOOK: list[JobBook] = []


def register_book(book: JobBook) -> None:
    """Make ``book`` the one job book (the Django app calls this as it is ready)."""
    _BOOK[:] = [book]


def registered_book() -> JobBook | None:
    """The job book, or None when no app registered one (the core keeps no jobs)."""
    return _BOOK[0] if _BOOK else None


def submitted(task: Any, args: Any, kwargs: Any, *, task_id: str | None, options: dict[str, Any]) -> Any:
    """``apply_async(..., job=True)``: the job of a new message of ``task`` (see :meth:`JobBook.submit`)."""
    from celery_guardrails.exceptions import GuardrailsError

    book = registered_book()
    if book is None:
        raise GuardrailsError(
            f"{task.name}: a job needs a job book to keep its record; add 'django_celery_guardrails' to "
            "INSTALLED_APPS (the Django app keeps jobs)"
        )
    return book.submit(task, args, kwargs, task_id=task_id, options=options)


def _unbooked(job_id: str, task: Any) -> None:
    logger.warning(
        "Task %s[%s]: its message works for job %s, but no job book is registered (add "
        "'django_celery_guardrails' to INSTALLED_APPS on this worker); its state is not written",
        getattr(task, "name", "?"),
        getattr(getattr(task, "request", None), "id", "?"),
        job_id,
    )


class JobTracking(Guardrail):
    """Writes the state of the job a message works for: ``running`` as its body starts, ``succeeded`` as it
    returns (in the effect's transaction when ``atomic``); the other states come from the signals below."""

    def before_run(self, task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        job_id = headers.job_id(view(task).header)
        if job_id is None:
            return
        book = registered_book()
        if book is None:
            _unbooked(job_id, task)
            return
        request = task.request
        attempt = headers.counter(view(task).header, headers.ATTEMPT) + 1
        try:
            start = book.started(
                job_id=job_id, task_id=str(request.id), attempt=attempt, requeued=_requeued(view(task).header)
            )
        except Exception as exc:  # a view of the work, never a reason to refuse it
            logger.warning("Task %s[%s]: job %s not marked running (%r)", task.name, request.id, job_id, exc)
            delivery(task).job = job_id
            return
        if not start.run:
            logger.info("Task %s[%s]: job %s was %s; its body does not run", task.name, request.id, job_id, start.was)
            raise SkipBody(None)
        delivery(task).job = job_id

    def body_context(self, task: Task) -> AbstractContextManager[Any] | None:
        if delivery(task).job is None or not view(task).options["atomic"] or delivery(task).claim is None:
            return None
        return self._succeeded_with_the_effect(task)

    @contextmanager
    def _succeeded_with_the_effect(self, task: Task) -> Iterator[None]:
        yield
        # Inside the Idempotency guardrail's transaction.atomic(): the job reads succeeded when the effect and
        # its key commit, and not at all if they roll back (a write that fails here rolls them back too).
        state = delivery(task)
        book = registered_book()
        if book is not None and state.job is not None:
            book.moved(_move(task, state.job, SUCCEEDED))
            state.job_written = True

    def on_success(self, task: Task, retval: Any) -> None:
        state = delivery(task)
        if state.job is None or state.job_written or not state.body_ran:
            return
        write(task, _move(task, state.job, SUCCEEDED))


#: The detail of a job queued again because the run of its message never ended.
WORKER_LOST = "worker lost"


def _requeued(header: Any) -> str:
    """Why a message whose job reads running came again: its hard time limit killed the run (the worker's main
    process re-published it with that record: it writes no job state itself, since the killed child may still
    hold the database), or its worker died (nothing recorded)."""
    history = header.get(headers.HISTORY) or ()
    last = history[-1] if history and isinstance(history[-1], dict) else {}
    return "time_limit" if last.get("rule") == "time_limit" else WORKER_LOST


def _move(task: Any, job_id: str, state: str, **fields: Any) -> JobMove:
    header = view(task).header
    return JobMove(
        job_id=job_id,
        task_id=str(task.request.id),
        state=state,
        attempt=headers.counter(header, headers.ATTEMPT) + 1,
        ran=delivery(task).body_ran,
        **fields,
    )


def write(task: Any, move: JobMove) -> None:
    """Report ``move`` to the job book; never raises (a failure is one warning with the ids)."""
    book = registered_book()
    if book is None:
        _unbooked(move.job_id, task)
        return
    try:
        if book.moved(move) and move.state in TERMINAL:
            state = delivery(task) if _runs(task, move.task_id) else None
            if state is not None:
                state.job_written = True
    except Exception as exc:
        logger.warning(
            "Task %s[%s]: job %s not marked %s (%r)",
            getattr(task, "name", "?"),
            move.task_id,
            move.job_id,
            move.state,
            exc,
        )


def _runs(task: Any, task_id: str | None) -> bool:
    """Whether ``task`` is running the delivery ``task_id`` now (a worker's, not a caller's call)."""
    request = getattr(task, "request", None)
    return bool(
        task_id
        and request is not None
        and getattr(request, "id", None) == task_id
        and not (request.called_directly or request.is_eager)
    )


def _current_job(task: Any, task_id: str | None) -> str | None:
    """The job of the delivery ``task_id`` that ``task`` runs now, if it works for one."""
    if not _runs(task, task_id) or not getattr(type(task), "guardrails_composed", False):
        return None
    return headers.job_id(view(task).header)


def summary(task: Any, exc: BaseException | None) -> str:
    """``ExceptionClass: message`` of ``exc``, redacted with the task's settings and cut (never raises)."""
    if exc is None:
        return ""
    try:
        return kept_text(task, f"{type(exc).__name__}: {exc}", ERROR_LIMIT)
    except Exception:
        return type(exc).__name__


# The other states come from the guardrails' signals, sent on the worker as each path is taken.


def _on_retry_scheduled(
    sender: Any = None,
    task_id: str | None = None,
    kind: str = "",
    delay: float | None = None,
    rule: str = "",
    exc: BaseException | None = None,
    **_: Any,
) -> None:
    job_id = _current_job(sender, task_id)
    if job_id is None:
        return
    state = RETRYING if kind == "transient" else WAITING
    due = time.time() + delay if delay is not None else None
    write(sender, _move(sender, job_id, state, detail=str(rule or kind), error=summary(sender, exc), due=due))


def _on_retry_deferred(
    sender: Any = None, task_id: str | None = None, reason: str = "", delay: float | None = None, **_: Any
) -> None:
    job_id = _current_job(sender, task_id)
    if job_id is not None:
        due = time.time() + delay if delay is not None else None
        write(sender, _move(sender, job_id, WAITING, detail=str(reason), due=due))


def _on_store_unavailable(sender: Any = None, task_id: str | None = None, delay: float | None = None, **_: Any) -> None:
    job_id = _current_job(sender, task_id)
    if job_id is not None:
        due = time.time() + delay if delay is not None else None
        write(sender, _move(sender, job_id, WAITING, detail="store_unavailable", due=due))


def _on_final_failure(sender: Any = None, failure: Any = None, **_: Any) -> None:
    # Sent once the dead letter is durable: on the worker, or in its main process for a hard time limit (where
    # the failure's header, not a delivery's view, names the job).
    job_id = headers.job_id(getattr(failure, "header", None) or {})
    if job_id is None:
        return
    move = JobMove(
        job_id=job_id,
        task_id=str(failure.task_id),
        state=DEAD_LETTERED,
        attempt=int(getattr(failure, "attempts", 0) or 0),
        detail=str(failure.reason),
        error=f"{failure.exc_type.rpartition('.')[2]}: {failure.exc_message}"[:ERROR_LIMIT]
        if failure.exc_type
        else str(failure.reason),
        dead_letter=str(failure.task_id),
    )
    write(sender, move)


def _on_duplicate_skipped(sender: Any = None, task_id: str | None = None, state: str = "", **_: Any) -> None:
    job_id = _current_job(sender, task_id)
    if job_id is None:
        return
    if state == "completed":
        write(sender, _move(sender, job_id, SUCCEEDED, detail="duplicate of a completed key"))
    else:
        write(sender, _move(sender, job_id, FAILED, detail=f"duplicate of a {state} key"))


def _on_stale_skipped(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    job_id = _current_job(sender, task_id)
    if job_id is not None:
        write(sender, _move(sender, job_id, FAILED, detail="stale: its ordering key had moved past it"))


signals.retry_scheduled.connect(_on_retry_scheduled, weak=False, dispatch_uid="celery_guardrails.jobs.retry")
signals.retry_deferred.connect(_on_retry_deferred, weak=False, dispatch_uid="celery_guardrails.jobs.deferred")
signals.store_unavailable.connect(_on_store_unavailable, weak=False, dispatch_uid="celery_guardrails.jobs.store")
signals.final_failure.connect(_on_final_failure, weak=False, dispatch_uid="celery_guardrails.jobs.final")
signals.duplicate_skipped.connect(_on_duplicate_skipped, weak=False, dispatch_uid="celery_guardrails.jobs.dup")
signals.stale_skipped.connect(_on_stale_skipped, weak=False, dispatch_uid="celery_guardrails.jobs.stale")


class RunningJob:
    """``self.job`` in a bound body whose message works for a job: its id, and progress reports."""

    def __init__(self, *, task: Any, job_id: str | None) -> None:
        self.task = task
        self.id = job_id
        self._last_write: float | None = None

    def cancel_requested(self) -> bool:
        """Whether a cancel was asked while the job runs (it runs to its end: a body of many steps asks between
        them and stops early). False without a job or a job book; a book that cannot answer is logged: False."""
        book = registered_book()
        if self.id is None or book is None:
            return False
        try:
            job = book.describe(self.id)
        except Exception as exc:
            logger.warning("Task %s: job %s's cancel not read (%r)", self.task.name, self.id, exc)
            return False
        return job is not None and (job.cancel_requested_at is not None or job.state == CANCELLED)

    def progress(self, done: int, total: int | None = None) -> None:
        """Report that ``done`` of ``total`` items are done: written at most once every
        ``job_progress_interval`` seconds, and at once when ``done`` reaches ``total``. Never raises."""
        if self.id is None:
            return
        now = time.monotonic()
        interval = view(self.task).options["job_progress_interval"]
        finished = total is not None and done >= total
        if not finished and self._last_write is not None and now - self._last_write < interval:
            return
        self._last_write = now
        book = registered_book()
        if book is None:
            return
        try:
            book.progress(job_id=self.id, done=max(0, int(done)), total=None if total is None else max(0, int(total)))
        except Exception as exc:
            logger.warning(
                "Task %s[%s]: job %s progress not written (%r)", self.task.name, self.task.request.id, self.id, exc
            )
