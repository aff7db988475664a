"""Wiring celery-guardrails into a Celery app.

``GuardedTask`` calls :func:`install` when it is bound to an app, so switching a task's base class is all a
project does. Installing adds :class:`GuardrailsBootstep` to the app's worker blueprint: it validates the
``guardrails`` config and every guarded task's options as the worker starts, so a typo stops the worker with
an error that names the key, instead of silently running without a guardrail. It also adds the watchdog
(:mod:`celery_guardrails.scheduling.watchdog`), the opt-in metrics endpoint
(:mod:`celery_guardrails.operations.metrics`) and,
to the consumer blueprint, the guard that keeps a worker alive through a restart of its Redis broker
(:mod:`celery_guardrails.broker.restart_guard`), and the heartbeat that keeps the deliveries it holds from being
redelivered (:mod:`celery_guardrails.broker.lease`); on a Redis broker it selects the
transport whose pop cannot lose a message (:mod:`celery_guardrails.broker.atomic_pop`).

The redacting log filters go on Celery's trace logger (for guarded tasks' records) and on the extension's own
loggers (:func:`celery_guardrails.log.install_filters`) when this module is imported (so before a Django web
process or a command logs anything of the extension's), and again whenever Celery sets up the worker's logging.

The publish/run signal handlers of the context guardrail are connected when :mod:`celery_guardrails` is
imported; they do not depend on the app.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.signals import after_setup_logger, after_setup_task_logger

from celery_guardrails import options
from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.log import ContextFilter, install_filters

logger = logging.getLogger(__name__)


class GuardrailsBootstep(bootsteps.Step):  # type: ignore[misc]
    """Worker start-up: refuse to start on a bad guardrails config."""

    label = "Guardrails"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        from celery_guardrails.runtime.pipeline import is_guarded

        app = parent.app
        settings = options.app_settings(app)
        # Poison protection, idempotency keys and budgets need a store: no store is a start-up error.
        from celery_guardrails.stores import store_url

        store_url(app)
        guarded = [task for task in app.tasks.values() if is_guarded(task)]
        for task in guarded:
            options.validate_task(task)
        options.import_paths(app, guarded)
        # A policy for an entry that does not exist, or a schedule that cannot be read, stops the worker too.
        from celery_guardrails.scheduling.beat import check_tasks, configured_entries

        try:
            entries = configured_entries(app, every_row=False)
        except ConfigurationError:
            raise
        except Exception:  # django-celery-beat's rows out of reach (database down, not migrated): not the worker's
            logger.warning("celery-guardrails: the beat entries could not be read to check them", exc_info=True)
            entries = {}
        check_tasks(app, entries)
        # Before the consumer connects: its connection is made with the transport chosen here.
        from celery_guardrails.broker.atomic_pop import configure

        atomic = configure(app)
        from celery_guardrails.guardrails.pop_claims import enable

        claims = atomic and enable(app, hostname=parent.hostname, pool=getattr(parent, "pool_cls", None))
        # One summary line says what the extension changed in the worker (a replaced transport, a patched
        # consumer): an operator reading the start-up should not have to find it in a separate INFO line.
        logger.info(
            "celery-guardrails: %d guarded task(s); broker: %s; app settings %s",
            len(guarded),
            "; ".join(broker_changes(app, atomic=atomic, claims=claims)),
            sorted(settings),
        )
        warn_about(app, guarded, pool=getattr(parent, "pool_cls", None))
        super().__init__(parent, **kwargs)


def broker_changes(app: Any, *, atomic: bool, claims: bool = False) -> list[str]:
    """What the extension changes in this worker's broker handling, as the start-up summary says it."""
    from celery_guardrails.broker.atomic_pop import TRANSPORT
    from celery_guardrails.broker.kind import broker_kind
    from celery_guardrails.broker.restart_guard import affected

    said = []
    if atomic:
        said.append(
            f"kombu's Redis transport replaced by {TRANSPORT} (atomic pop: a worker killed as a message is handed "
            "to it loses nothing; broker_atomic_pop=False keeps kombu's)"
        )
    if claims:
        said.append("idempotency keys claimed by the pop that takes their message (claim_on_pop)")
    if not atomic:
        said.append(f"transport {app.conf.broker_transport or str(app.conf.broker_url or '').split('://')[0]} as set")
    if broker_kind(app).redis and options.app_value(app, "broker_restart_guard") and affected():
        said.append("consumer patched to outlive a Redis restart (broker_restart_guard)")
    return said


def warn_about(app: Any, guarded: list[Any], *, pool: Any = None) -> None:
    """Start-up warnings: the audit's own rules (:func:`celery_guardrails.operations.audit.startup_rules` and
    :func:`~celery_guardrails.operations.audit.owner_rules`), so a worker says at start what the audit grades,
    with the same thresholds; an error (the zero rule) as an error, a warning as a warning, the information too
    (a task the gate never retries: worth knowing at the first start after an upgrade to the gate)."""
    from celery_guardrails.operations.audit import ERROR, WARNING, owner_rules, startup_rules

    unowned = [finding.subject for finding in owner_rules(guarded)]
    if unowned:
        # One line for all (GA401 each in the audit): a project with many unowned tasks gets no wall of lines.
        logger.warning(
            "celery-guardrails: %d task(s) can dead-letter with no owner to alert (set owner= or the "
            "owners setting): %s",
            len(unowned),
            ", ".join(sorted(unowned)),
        )
    levels = {ERROR: logging.ERROR, WARNING: logging.WARNING}
    try:
        findings = startup_rules(app, pool=pool)
    except Exception as exc:  # a start-up warning never stops a worker: say it could not be read, and go on
        logger.warning("celery-guardrails: the audit's rules could not be read: %r", exc)
        findings = []
    for finding in findings:
        logger.log(
            levels.get(finding.severity, logging.INFO),
            "celery-guardrails: %s %s: %s; fix: %s",
            finding.code,
            finding.subject,
            finding.message,
            finding.fix,
        )


def install(app: Any) -> None:
    """Add the guardrails bootsteps to ``app`` (idempotent)."""
    if getattr(app, "_guardrails_installed", False):
        return
    app._guardrails_installed = True
    app.steps["worker"].add(GuardrailsBootstep)
    from celery_guardrails.scheduling.watchdog import WatchdogStep

    app.steps["worker"].add(WatchdogStep)
    from celery_guardrails.operations.metrics import MetricsEndpoint

    app.steps["worker"].add(MetricsEndpoint)
    from celery_guardrails.operations.activity import ActivityStep

    app.steps["worker"].add(ActivityStep)
    from celery_guardrails.runtime.outbox import OutboxRelayStep

    app.steps["worker"].add(OutboxRelayStep)
    from celery_guardrails.broker.restart_guard import BrokerRestartGuard

    app.steps["consumer"].add(BrokerRestartGuard)
    from celery_guardrails.broker.lease import BrokerLeaseStep

    app.steps["consumer"].add(BrokerLeaseStep)


def _add_context_filter(logger: logging.Logger | None = None, **_: Any) -> None:
    # Celery configured its own handlers (worker_hijack_root_logger=True): give their records the context
    # fields, so a format such as "%(tenant)s %(correlation_id)s" works there too.
    for handler in getattr(logger, "handlers", ()):
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())


after_setup_logger.connect(_add_context_filter, weak=False, dispatch_uid="celery_guardrails.log.worker")
after_setup_task_logger.connect(_add_context_filter, weak=False, dispatch_uid="celery_guardrails.log.task")
# Celery's logging set-up may replace what a project configured: the redacting filters are put back (idempotent).
after_setup_logger.connect(install_filters, weak=False, dispatch_uid="celery_guardrails.log.redacting")
install_filters()
