"""The audit's entry points: :func:`audit` imports the app's task modules as a worker does, reads the project's
source and tests (:func:`source_walks`), runs every axis' rules in the rubric's order and scores them
(:func:`~celery_guardrails.operations.audit.model.report_of`); :func:`startup_rules` is the subset a worker logs
as it starts (the retry, visibility and redaction rules), so the audit and the worker share one rule set.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from celery_guardrails.operations import audit_source
from celery_guardrails.operations.audit.dead_letters import dead_letter_rules
from celery_guardrails.operations.audit.kit_use import kit_rules
from celery_guardrails.operations.audit.message_design import message_design_rules, redaction_rules
from celery_guardrails.operations.audit.model import Finding, Report, report_of
from celery_guardrails.operations.audit.observability import observability_rules
from celery_guardrails.operations.audit.ordering import ordering_rules, visibility_rules
from celery_guardrails.operations.audit.placement import connection_rules, placement_rules
from celery_guardrails.operations.audit.retries import retry_rules
from celery_guardrails.operations.audit.scheduling import schedule_rules
from celery_guardrails.operations.audit.tasks import graded_tasks


def audit(app: Any, *, source: str | os.PathLike[str] | None = None) -> Report:
    """Grade ``app``: its config, guardrails options, registered tasks and the project's source (no broker,
    store or database read). ``source``: the folder of the project's code (default: see the package docstring,
    :mod:`celery_guardrails.operations.audit`).

    Raises :class:`~celery_guardrails.exceptions.ConfigurationError` when the guardrails settings themselves
    are invalid (the worker would not start: that is the first thing to fix).
    """
    from celery_guardrails.options import app_settings

    app_settings(app)  # an invalid config is reported as such, before anything is graded against it
    # The app's task modules (include, imports, autodiscovery), as a worker imports them; when that fails, what
    # is registered is graded (the CLI says the import failed).
    with contextlib.suppress(Exception):
        app.loader.import_default_modules()
    tasks = graded_tasks(app)
    from celery_guardrails.runtime.pipeline import is_guarded

    guarded = [task for task in tasks if is_guarded(task)]
    code, tests = source_walks(source)
    findings: list[Finding] = []
    findings += placement_rules(app, code)
    findings += message_design_rules(app, tasks, guarded)
    findings += retry_rules(app, tasks)
    findings += dead_letter_rules(app, guarded)
    findings += ordering_rules(app, tasks, guarded)
    findings += schedule_rules(app)
    findings += observability_rules(app)
    findings += kit_rules(guarded, tests)
    return report_of(findings, source=str(code.root), tests_source=str(tests.root))


def _django_base_dir() -> Path | None:
    from celery_guardrails.operations.alert_channels import django_configured

    if not django_configured():
        return None
    from django.conf import settings

    base = getattr(settings, "BASE_DIR", None)
    return Path(base).resolve() if base else None


def source_walks(source: str | os.PathLike[str] | None = None) -> tuple[audit_source.Walk, audit_source.Walk]:
    """The walks of the project's code and of its tests (the package docstring says which folders)."""
    if source is not None:
        walked = audit_source.walk(Path(source).resolve())
        return walked, walked
    base = _django_base_dir()
    if base is None:
        walked = audit_source.walk(Path.cwd())
        return walked, walked
    walked = audit_source.walk(base)
    if walked.tests() or not walked.complete:
        return walked, walked
    # BASE_DIR holds no test of its own: the project's tests sit beside it (a repository's tests/ folder).
    return walked, audit_source.walk(base.parent)


def startup_rules(app: Any, *, pool: Any = None) -> list[Finding]:
    """The audit's rules a worker logs as it starts (:func:`celery_guardrails.runtime.install.warn_about`), for
    the app's graded tasks: the retry rules (GA201, GA202, GA3xx), the visibility rule (GA501), the redaction
    rule (GA106) and the connection rule (GA006, for the worker's ``pool``). The owner rule (GA401) is logged
    there too, as one line naming every task."""
    tasks = graded_tasks(app)
    from celery_guardrails.runtime.pipeline import is_guarded

    guarded = [task for task in tasks if is_guarded(task)]
    return (
        retry_rules(app, tasks)
        + visibility_rules(app, tasks)
        + redaction_rules(app, guarded)
        + connection_rules(app, pool=pool)
    )
