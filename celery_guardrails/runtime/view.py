"""One delivery's resolved view: its message's guardrails header and its task's options, each read once.

Every hook of a delivery asks the same questions of the message (its tenant, attempt history, per-call options)
and of the task (its retention, lease, backoff: the lookup rule of :mod:`celery_guardrails.options.lookup`).
Before this view each hook read them again: one keyed delivery parsed and copied the header about 21 times and
ran the lookup rule 82 times. The view reads the header once, when the delivery first needs it, and resolves
each option once, when first asked (:class:`~celery_guardrails.options.TaskOptions`); every hook of that
delivery reads the same values (:func:`celery_guardrails.runtime.delivery.view`).

The header is read-only here (a ``MappingProxyType``): a hook that makes the next message's header builds a new
mapping from it (:func:`celery_guardrails.runtime.headers.with_record`), so what one hook reads is what the
next hook reads too. Publishing (``on_publish``) is not a delivery: its hooks resolve with the publication's
per-call options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from celery_guardrails.foundation.redaction import Redactor, for_task
from celery_guardrails.options.lookup import TaskOptions
from celery_guardrails.runtime import headers


@dataclass(slots=True, kw_only=True)
class DeliveryView:
    """The header and the options of one delivery, as its hooks read them."""

    #: The request it was read from (a view is its request's only: see
    #: :func:`celery_guardrails.runtime.delivery.view`).
    request: Any
    #: The message's guardrails header, sanitised (read-only).
    header: Mapping[str, Any]
    #: The task's options for this message (its per-call options first), each resolved once.
    options: TaskOptions
    #: The task's redactor, once made (:attr:`redaction`).
    redactor: Redactor | None = None

    @property
    def redaction(self) -> Redactor:
        """The task's redactor (``redact_keys``, ``redact_patterns``: never per call, so a message cannot turn
        its own redaction off), made when first asked."""
        if self.redactor is None:
            self.redactor = for_task(self.options.task)
        return self.redactor

    @classmethod
    def read(cls, task: Any) -> DeliveryView:
        """The view of the delivery ``task.request`` stands for: its header read once."""
        # No request: an object standing for a task this process has not registered (the outbox's record of a
        # row it cannot publish): no message header, the app's options.
        request = getattr(task, "request", None)
        header = headers.from_request(request) if request is not None else {}
        call = MappingProxyType(dict(headers.call_options(header)))
        return cls(request=request, header=MappingProxyType(header), options=TaskOptions(task=task, call=call))
