"""Publishing later than the call: on the commit of the caller's transaction, through the outbox, or as a job.

:class:`DeferredPublish` is mixed into ``GuardedTask`` (:mod:`celery_guardrails.runtime.task`): the methods a
caller uses to tie a message to its database transaction. The publish itself is ``GuardedTask.apply_async``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from celery_guardrails.options import OPTIONS, check_call_options, resolve, settings_snapshot


class DeferredPublish:
    """``delay_on_commit``, ``apply_async_on_commit``, ``enqueue_in_transaction`` and ``submit``."""

    name: str
    app: Any

    if TYPE_CHECKING:  # GuardedTask's

        def apply_async(self, *args: Any, **kwargs: Any) -> Any: ...

    # Transactional enqueue (Django). Celery's DjangoTask has delay_on_commit; GuardedTask derives from
    # celery.Task, so it brings its own, which also carries the caller's tenant and correlation id.

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay`` once the current database transaction commits (nothing if it rolls back): Celery's
        ``DjangoTask.delay_on_commit``, with the caller's tenant and correlation id captured now."""
        self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(
        self, args: Any = None, kwargs: Any = None, *, using: str | None = None, **options: Any
    ) -> None:
        """``apply_async`` once the transaction of database ``using`` commits. The payload contract and
        ``tenant_required`` are checked now, in the caller. A crash between the commit and the publish loses the
        message: where that matters, use the outbox (``enqueue_in_transaction``)."""
        from django.db import transaction

        self.prepare_deferred(args, kwargs, options)
        transaction.on_commit(functools.partial(self.apply_async, args, kwargs, **options), using=using)

    def prepare_deferred(self, args: Any, kwargs: Any, options: dict[str, Any]) -> None:
        """For a message published later than the call (on commit, through the outbox): the caller's tenant and
        correlation id put in ``options`` (unless given), and what a publish refuses (``tenant_required``, the
        payload contract) refused now, in the caller."""
        from celery_guardrails.exceptions import MissingTenantError
        from celery_guardrails.foundation.context import current_correlation_id, current_tenant
        from celery_guardrails.guardrails.contract import check_payload

        with settings_snapshot(self.app):
            for name, value in (("tenant", current_tenant()), ("correlation_id", current_correlation_id())):
                if value is not None and options.get(name) is None:
                    options[name] = value
            call = check_call_options({name: options[name] for name in options if name in OPTIONS})
            if options.get("tenant") is None and resolve(self, "tenant_required", call):
                raise MissingTenantError(self.name, where="given at publish")
            check_payload(self, tuple(args or ()), dict(kwargs or {}), call)

    def enqueue_in_transaction(self, *args: Any, **kwargs: Any) -> Any:
        """Write this task's message in the caller's database transaction, for the outbox relay to publish once
        it committed (see ``django_celery_guardrails.outbox``); the message's ``AsyncResult``. The same as
        ``apply_async(args, kwargs, outbox=True)``."""
        return self.apply_async(args, kwargs, outbox=True)

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Submit a job a user can poll: its record is written in the caller's database transaction and its
        message goes out once that commits (through the outbox unless ``job_outbox`` is off); the ``Job``
        (``django_celery_guardrails.models.Job``). The same as ``apply_async(args, kwargs, job=True)``; see
        :mod:`celery_guardrails.guardrails.jobs`."""
        return self.apply_async(args, kwargs, job=True)
