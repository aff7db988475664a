"""``GuardedTask``: the Celery task base class that composes the guardrails.

It holds no guardrail logic of its own: it collects the per-call options, runs the hooks of
``GuardedTask.guardrails`` in the order documented in :mod:`celery_guardrails.runtime.pipeline`, and leaves the rest
to Celery.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid
from kombu.exceptions import EncodeError

from celery_guardrails.exceptions import GuardrailsError, StoreError, StoreUnavailableError, UnpublishableError
from celery_guardrails.foundation.faults import fault_point
from celery_guardrails.guardrails.acks import StoreAck
from celery_guardrails.guardrails.budget import RetryBudget
from celery_guardrails.guardrails.concurrency import ConcurrencyLimit
from celery_guardrails.guardrails.contract import PayloadContract
from celery_guardrails.guardrails.idempotency import Idempotency
from celery_guardrails.guardrails.jobs import JobTracking, RunningJob, submitted
from celery_guardrails.guardrails.ordering import Ordering, SequenceStamp
from celery_guardrails.guardrails.pending_dead_letters import PendingDeadLetters
from celery_guardrails.guardrails.poison import PoisonMessages
from celery_guardrails.guardrails.pop_claims import ClaimOnPop
from celery_guardrails.guardrails.propagation import ContextPropagation
from celery_guardrails.guardrails.records import require
from celery_guardrails.guardrails.retries import Retries, RetryRequested
from celery_guardrails.guardrails.scheduled_runs import ScheduledRuns
from celery_guardrails.guardrails.tenancy import TenantGuard
from celery_guardrails.guardrails.waiting import Waiting
from celery_guardrails.operations.metrics import Metrics
from celery_guardrails.options import OPTIONS, check_call_options, settings_snapshot
from celery_guardrails.runtime import headers, outbox, request_stack
from celery_guardrails.runtime.checkpoint import Checkpoint, Checkpoints, checkpoint_of
from celery_guardrails.runtime.deferred import DeferredPublish
from celery_guardrails.runtime.delivery import Delivery, begin, delivery, view
from celery_guardrails.runtime.effects import effect, guard_request
from celery_guardrails.runtime.install import install
from celery_guardrails.runtime.outcomes import (
    GUARDRAIL_ERROR,
    MALFORMED_MESSAGE,
    STORE_REFUSED,
    attempt_record,
    fail_finally,
    store_unavailable,
)
from celery_guardrails.runtime.pipeline import Guardrail, Publication, SkipBody, SkipPublish, overriding
from celery_guardrails.runtime.results import redacting_backend

logger = logging.getLogger(__name__)

#: Per-call keyword arguments of ``apply_async`` that set the message's context rather than an option.
CONTEXT_OVERRIDES = frozenset({"tenant", "correlation_id"})


def _later(options: Mapping[str, Any], link: Any, link_error: Any) -> tuple[Any, ...]:
    """The signatures a message carries for the worker to publish after it (see ``Publication.later``)."""
    later: list[Any] = list(options.get("chain") or ())
    if options.get("chord"):
        later.append(options["chord"])
    for callbacks in (link, link_error):
        if callbacks:
            later.extend(callbacks if isinstance(callbacks, list | tuple) else [callbacks])
    return tuple(later)


class GuardedTask(DeferredPublish, Task):  # type: ignore[misc]
    """Base class for guarded tasks: ``@shared_task(base=GuardedTask, bind=True, tenant_required=True)``."""

    #: The guardrails, in pipeline order. Extend with ``guardrails = (*GuardedTask.guardrails, Mine())``.
    #: Retries sets the attempt number RetryBudget needs; Idempotency claims last (nothing is claimed for
    #: a delivery the budget defers) and wraps the body inside Retries, so that a transaction it opens is
    #: rolled back before a retry is published. ScheduledRuns comes after it: a period that ran before is
    #: skipped as a duplicate before it could take the schedule's run slot. ConcurrencyLimit takes its slots
    #: last, when every other guardrail agreed to run the body: a duplicate of a completed key, a deferred
    #: delivery or a skipped period never holds a slot others wait for.
    #: Ordering comes after Retries (it reads the attempt; Retries, outermost around the body, has classified
    #: the outcome before Ordering sees it, reversed) and before RetryBudget and Idempotency: a message waits
    #: for its turn without spending a budget admission or holding its key, and a duplicate skipped in its turn
    #: still moves its ordering key on. SequenceStamp (publish only) is last: a publish another guardrail
    #: refuses or skips (dedupe_on_publish) takes no sequence number.
    #: PayloadContract checks a publish before any guardrail reserves or stamps anything for it, and refuses a
    #: payload version the worker does not accept before any guardrail acts on the delivery.
    #: Metrics is first: its before_run sees every delivery before a guardrail can refuse it, and its after-hooks
    #: run last, so the duration it records covers every guardrail (it records nothing unless ``metrics`` is on).
    #: JobTracking marks a job running once every guardrail before it agreed to run the body (a deferred or
    #: refused delivery never reads as running); its body context is inside Idempotency's transaction, so an
    #: atomic job reads succeeded when its effect and key commit. Checkpoints stays innermost.
    #: Waiting comes next: it removes the waiting row of a message that was re-published with a countdown before
    #: any guardrail could re-publish it again (which writes the row anew; see celery_guardrails.guardrails.waiting).
    #: StoreAck is before them all: a completion that rides the ack is made after every other success hook.
    #: ClaimOnPop comes next: the claim its message's pop made is held before any guardrail can end the delivery.
    guardrails: ClassVar[tuple[Guardrail, ...]] = (
        StoreAck(),
        ClaimOnPop(),
        Metrics(),
        Waiting(),
        ContextPropagation(),
        PendingDeadLetters(),
        PoisonMessages(),
        PayloadContract(),
        TenantGuard(),
        Retries(),
        Ordering(),
        RetryBudget(),
        Idempotency(),
        ScheduledRuns(),
        ConcurrencyLimit(),
        JobTracking(),
        Checkpoints(),
        SequenceStamp(),
    )

    #: The ack is sacred: a message is acked only after the task finished, its retry was published or its
    #: final failure was handed over; a worker that dies mid-task leaves it to be delivered again.
    acks_late = True
    #: Marks the class guarded for :func:`~celery_guardrails.runtime.pipeline.is_guarded`.
    guardrails_composed: ClassVar[bool] = True
    #: A child process that dies mid-task gives its message back (poison protection bounds the loop).
    reject_on_worker_lost = True
    #: The worker's request: a malformed envelope and a hard time limit end in a record, not an ack alone.
    Request = "celery_guardrails.runtime.request:GuardedRequest"
    #: The worker's strategy: a body that cannot be decoded is dead-lettered, not logged and acked.
    Strategy = "celery_guardrails.runtime.request:strategy"

    # Guardrail options as task attributes, one per option a task may set (TASK scope; a test checks the set against
    # the schema): typed here for the type checker and the reader. None means "not set here", so the app config
    # applies.
    tenant_required: bool | None = None
    tenant_activator: Any = None
    owner: str | None = None
    redact_keys: Any = None
    redact_patterns: Any = None
    redact_results: bool | None = None
    max_deliveries: int | None = None
    idempotent: bool | None = None
    retry_unsafe: bool | None = None
    marks_effects: bool | None = None
    idempotency_key: Any = None
    idempotency_lease: float | None = None
    idempotency_retention: float | None = None
    atomic: bool | None = None
    dedupe_on_publish: bool | None = None
    dedupe_ttl: float | None = None
    max_attempts: int | None = None
    transient_errors: Any = None
    permanent_errors: Any = None
    deterministic_errors: Any = None
    error_patterns: Any = None
    unknown_errors: str | None = None
    backoff: str | None = None
    backoff_base: float | None = None
    backoff_max: float | None = None
    backoff_random: Any = None
    retry_later_delay: float | None = None
    retry_later_max: int | None = None
    record_wait: float | None = None
    absent_records: str | None = None
    dependency: str | None = None
    retry_budget_ratio: float | None = None
    retry_budget_floor: int | None = None
    retry_budget_window: float | None = None
    retry_budget_policy: str | None = None
    retry_budget_max_deferrals: int | None = None
    circuit_threshold: int | None = None
    circuit_open_seconds: float | None = None
    circuit_half_open_probes: int | None = None
    circuit_probe_timeout: float | None = None
    ordering_key: Any = None
    ordering_gap_timeout: float | None = None
    ordering_gap_alert_after: float | None = None
    ordering_wait_max: float | None = None
    ordering_retention: float | None = None
    concurrency_key: Any = None
    concurrency_limit: int | None = None
    exclusive_key: Any = None
    concurrency_reap_after: float | None = None
    concurrency_max_waits: int | None = None
    payload_version: int | None = None
    accepts_versions: Any = None
    max_payload_bytes: int | None = None
    max_payload_depth: int | None = None
    sensitive_keys: Any = None
    allow_sensitive_payload: str | None = None
    job_progress_interval: float | None = None
    job_outbox: bool | None = None

    # Resumable chunks (issue #14): ``for item in self.checkpoint.iterate(items, every=100)`` in a bound body
    # records the position reached, keyed by the job, and resumes from it on the next delivery. Checkpoints
    # (the last guardrail with a body context) is innermost around the body: a chunk commits or rolls back
    # before the key is completed or a retry is published; on success the checkpoint is cleared (keyed) or
    # marked done until its retention (no key), since the ack comes later (see celery_guardrails.runtime.checkpoint).
    @property
    def checkpoint(self) -> Checkpoint:
        return checkpoint_of(self)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        install(app)
        request_stack.install(cls)  # task.request in a fraction of Celery's time (runtime/request_stack.py)
        # A duplicate of a message whose key failed for good is refused by design (its dead letter is the record):
        # Celery logs an exception in ``throws`` as one INFO line "raised expected", not an ERROR with a
        # traceback. Added to what the task declares itself.
        from celery_guardrails.exceptions import DuplicateOfFailureError

        declared = tuple(cls.throws or ())
        if not any(issubclass(DuplicateOfFailureError, kind) for kind in declared):
            cls.throws = (*declared, DuplicateOfFailureError)

    # The result backend, its stored failures redacted (redact_results; see celery_guardrails.runtime.results): Celery's
    # tracer and the worker's request store an exception through ``task.backend``.
    @property
    def backend(self) -> Any:
        return redacting_backend(self, Task.backend.fget(self))

    @backend.setter
    def backend(self, value: Any) -> None:
        Task.backend.fset(self, value)

    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        with settings_snapshot(self.app):
            return self._publish(*args, **kwargs)

    def _publish(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        if options.pop("job", False):
            if link or link_error or producer or shadow:
                raise ValueError("job=True takes no link, link_error, producer or shadow (a job is one message)")
            return submitted(self, args, kwargs, task_id=task_id, options=options)
        if options.pop("outbox", False):
            if link or link_error or producer or shadow:
                raise ValueError("outbox=True takes no link, link_error, producer or shadow (not kept in the outbox)")

            return outbox.registered().enqueue(self, args, kwargs, task_id=task_id, **options)
        # Every guardrail option name is taken out (never passed on to Celery as a message property); one
        # that may not be set per call is refused here, naming the key.
        given = check_call_options({name: options.pop(name) for name in list(options) if name in OPTIONS})
        overrides = {name: options.pop(name) for name in CONTEXT_OVERRIDES & options.keys()}
        message_headers = dict(options.pop("headers", None) or {})
        # A django-celery-beat row can add message headers only (its kwargs are the task's arguments): a
        # "tenant" there is the row's tenant, as options={"tenant": ...} is a beat_schedule entry's.
        row_tenant = message_headers.pop("tenant", None)
        if row_tenant is not None:
            overrides.setdefault("tenant", row_tenant)
        header = headers.from_message_headers(message_headers)
        # A retry brings its own header back (Celery copies custom headers since celery#7555), per-call
        # options included; options given now win.
        call = {**headers.call_options(header), **given}
        if call:
            header[headers.OPTIONS] = call
        task_id = task_id or uuid()  # known before publishing, for guardrails that record it
        publication = Publication(
            task_id=task_id,
            args=tuple(args or ()),
            kwargs=dict(kwargs or {}),
            header=header,
            call=call,
            overrides=overrides,
            later=_later(options, link, link_error),
        )
        try:
            for guardrail in overriding(self.guardrails, "on_publish"):
                guardrail.on_publish(self, publication)
        except SkipPublish as skip:
            return self.AsyncResult(skip.task_id)
        message_headers[headers.HEADER] = publication.header
        return super().apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, headers=message_headers, **options
        )

    @property
    def job(self) -> RunningJob:
        """In a bound body: the job the message works for (``self.job.id``; None when it works for none) and
        its progress reports, ``self.job.progress(done, total)`` (nothing is written when there is no job)."""
        state = delivery(self)
        if not isinstance(state.job_handle, RunningJob):
            state.job_handle = RunningJob(task=self, job_id=headers.job_id(view(self).header))
        handle: RunningJob = state.job_handle
        return handle

    def effect(self) -> effect:
        """``with self.effect(): ...`` around the call that acts on the world: a failure before the body's first
        effect is retried, one after it is not (see :mod:`celery_guardrails.runtime.effects`)."""
        return effect(state=delivery(self))

    def require(self, queryset: Any, /, **lookup: Any) -> Any:
        """The one row of ``queryset`` matching ``lookup``; when there is none (yet), the message waits for it for
        at most ``record_wait`` (see :mod:`celery_guardrails.guardrails.records`)."""
        return require(queryset, **lookup)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """In the body: ask for a retry through the guardrails' one gate (raises; see
        :mod:`celery_guardrails.guardrails.retries`): it counts in ``max_attempts``, and it is refused, as a final
        failure ``not_idempotent``, when running the body again could repeat an effect. ``throw=False`` is not
        honoured there: the retry is decided when the body ends, so the call raises anyway.

        A guardrail re-publishing the message calls Celery's ``retry``, except that when the new message cannot
        be published Celery rejects the running message without requeue (``Reject(exc, requeue=False)`` in
        ``Task.retry``), which on an acks-late delivery removes it from the broker with nothing recorded. The ack
        is sacred: it is given back to the broker unacked instead, and runs again when it is redelivered (no
        attempt is recorded for it). A publish that refuses the retry itself (a ``ValueError``: a countdown or a
        route native delayed delivery does not take) is never given back: that would loop; it ends as a
        dead letter ``guardrail_error``."""
        state = delivery(self)
        if not self.request.called_directly and not state.republishing:
            if state.in_body and any(isinstance(g, Retries) for g in self.guardrails):
                raise RetryRequested.from_call(
                    cause=exc if exc is not None else sys.exc_info()[1],
                    eta=eta,
                    countdown=countdown,
                    max_retries=max_retries,
                    args=args,
                    kwargs=kwargs,
                    options=options,
                )
            if not state.in_body:
                raise GuardrailsError(
                    f"{self.name}: self.retry() outside the task body; a guarded task is retried only by the "
                    "guardrails' gate (raise TransientError or RetryLater from the body)"
                )
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Reject as rejected:
            if rejected.requeue:
                raise
            if isinstance(rejected.reason, EncodeError):
                # Not the broker: the serializer refuses the message's own arguments (a pickled object that will not
                # pickle again). Given back, it would come back and fail the same way, until the poison guard.
                raise UnpublishableError(self.name, f"its retry could not be encoded: {rejected.reason}") from rejected
            if isinstance(rejected.reason, ValueError):
                # Not the broker being away: the publish refuses the retry as asked (kombu's calculate_routing_key
                # on RabbitMQ's native delayed delivery: "countdown must be a positive number", "routing_key must
                # be non-empty"). Given back, the message would run again at once and be refused again: a requeue
                # loop with no attempt spent. It ends as a record (guardrail_error: replay it once fixed).
                raise GuardrailsError(
                    f"{self.name}: its retry was refused by the publish ({type(rejected.reason).__name__}: "
                    f"{rejected.reason}); recorded instead of given back to the broker"
                ) from rejected
            logger.error(
                "Task %s[%s]: its retry could not be published (%s); given back to the broker unacked",
                self.name,
                self.request.id,
                rejected.reason,
            )
            raise Reject(rejected.reason, requeue=True) from rejected

    def call_options(self) -> Mapping[str, Any]:
        """The per-call guardrail options of the message being executed (empty outside a task run)."""
        return view(self).options.call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with settings_snapshot(self.app):
            guard_request(self.request)
            state = begin(self.request)
            try:
                return self._run_guarded(state, args, kwargs)
            except StoreError as exc:
                if exc is state.body_error:  # the task's own (a guarded publish it made): Retries classified it
                    raise
                if isinstance(exc, StoreUnavailableError):
                    # The store cannot be reached: the infrastructure's fault, not the message's. It comes back
                    # later, no attempt spent (what it held is released first, or lapses with its lease).
                    store_unavailable(self, exc)
                # The store refused something about this message (data it cannot hold): a final failure with
                # the reason, never an ack with nothing recorded.
                record = attempt_record(self, kind="permanent", rule="store", exc=exc)
                history = [*getattr(self.request, "attempt_history", ()), record]
                fail_finally(self, exc, reason=STORE_REFUSED, history=history)
            except Exception as exc:
                if state.ended or isinstance(exc, Retry | Reject | Ignore) or self._in_caller():
                    raise
                self._unsettled(exc)

    def _in_caller(self) -> bool:
        """Run in the caller's process (``task(...)``, ``apply()``, eager): its exception reaches the caller."""
        request = self.request
        return bool(request.called_directly or request.is_eager)

    def _unsettled(self, exc: Exception) -> NoReturn:
        """Record an exception that left the guardrails with nothing settled: a guardrail failed on this message
        (a bug, a value it did not expect), or nothing classifies the body's errors. The ack is sacred: it is
        dead-lettered ``guardrail_error`` (``malformed_message`` for a retry whose arguments cannot be encoded)
        and ``exc`` raised (the task fails with it), or the message is published again pending, or given back
        to the broker (see :func:`celery_guardrails.runtime.outcomes.fail_finally`)."""
        logger.error(
            "Task %s[%s]: %s left the guardrails unsettled; recording it", self.name, self.request.id, type(exc)
        )
        reason = MALFORMED_MESSAGE if isinstance(exc, UnpublishableError) else GUARDRAIL_ERROR
        try:
            record = attempt_record(self, kind="permanent", rule=reason, exc=exc)
            history = [*getattr(self.request, "attempt_history", ()), record]
        except Exception:  # the history is lost, not the record
            logger.exception("Task %s[%s]: attempt record not made", self.name, self.request.id)
            history = []
        fail_finally(self, exc, reason=reason, history=history)

    def _run_guarded(self, state: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            for guardrail in overriding(self.guardrails, "before_run"):
                guardrail.before_run(self, args, kwargs)
            return self._run_body(state, args, kwargs)
        except SkipBody as skip:  # from a before_run, or a body context that decided before the body
            return skip.result

    def _run_body(self, state: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with ExitStack() as stack:
            for guardrail in overriding(self.guardrails, "body_context"):
                context = guardrail.body_context(self)
                if context is not None:
                    stack.enter_context(context)
            # Celery's tracer already pushed this request and task; Task.__call__ would push a copy of
            # both again (a custom __call__ is run in place of run()), for nothing. Celery's autoretry_for
            # wrapper (``_orig_run`` keeps the body) is left out: its retries would bypass the gate; the
            # Retries guardrail classifies autoretry_for as transient_errors instead.
            body: Any = super().__call__ if self.request.called_directly else self.__dict__.get("_orig_run", self.run)
            fault_point("body")  # after every guardrail (a test kit's worker can crash or hold it here)
            state.in_body = True
            try:
                retval = body(*args, **kwargs)
            except BaseException as exc:
                state.body_error = exc
                raise
            finally:
                state.in_body = False
                state.body_ran = True
            state.retval = retval  # for a body context that completes with the result
            return retval

    def _after(self, hook: str, *arguments: Any) -> None:
        """Run ``hook`` of every guardrail (reverse order), each on its own: one that raises is logged with
        the task's ids and does not keep the others (a completion to read, a slot to free) from running."""
        with settings_snapshot(self.app):
            for guardrail in reversed(overriding(self.guardrails, hook)):
                try:
                    getattr(guardrail, hook)(self, *arguments)
                except Exception:
                    logger.exception(
                        "Task %s[%s]: %s.%s failed", self.name, self.request.id, type(guardrail).__name__, hook
                    )

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        self._after("on_success", retval)
        super().on_success(retval, task_id, args, kwargs)

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        self._after("on_failure", exc, einfo)
        super().on_failure(exc, task_id, args, kwargs, einfo)

    def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        self._after("on_retry", exc, einfo)
        super().on_retry(exc, task_id, args, kwargs, einfo)
