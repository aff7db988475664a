"""Signals sent by celery-guardrails, for alerts, metrics and audits.

Connect to them like Celery's own signals::

    from celery_guardrails import signals

    @signals.missing_tenant.connect
    def page_someone(sender, task_id, task_name, reason, **kwargs): ...

``sender`` is the task object. Receivers run in the process that sends the signal (the worker, or the
publisher for publish-time signals); an exception in a receiver is logged by Celery and does not stop the
task.

missing_tenant
    A ``tenant_required`` task was delivered without a tenant and refused without running.
    Arguments: ``task_id``, ``task_name``, ``reason`` (a sentence), ``correlation_id``.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

missing_tenant = Signal(name="missing_tenant")
