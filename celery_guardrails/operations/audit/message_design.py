"""The message-design axis (GA1xx): what a message carries and who can read it. A plain Celery task (no context,
no retry gate, no dead letter, no payload contract), the payload limits turned off, sensitive payloads allowed,
a ``payload_version`` its own ``accepts_versions`` leaves out, and the redaction rule (:func:`redaction_rules`,
GA106) that the worker's start-up log and ``manage.py check`` share.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations.audit.model import ERROR, INFO, WARNING, Finding, finding
from celery_guardrails.options import app_value, resolve, task_attribute


def message_design_rules(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    """Message design (GA1xx): plain tasks, payload size and sensitive-key limits turned off, sensitive
    payloads allowed, a payload version its own workers refuse, and the redaction rule."""
    found = []
    for task in tasks:
        if task not in guarded:
            found.append(
                finding(
                    "GA101",
                    WARNING,
                    task.name,
                    "a plain Celery task: no tenant or correlation context, no retry gate, no dead letter, no "
                    "payload contract",
                    "make it a GuardedTask: @shared_task(base=GuardedTask, bind=True, ...)",
                )
            )
    if not app_value(app, "max_payload_bytes"):
        found.append(
            finding(
                "GA102",
                WARNING,
                "max_payload_bytes",
                "no payload size limit: any message size is published and retained",
                "remove max_payload_bytes=0 from the guardrails settings (default 65536); send a reference "
                "to stored data instead of the data",
            )
        )
    if not app_value(app, "sensitive_keys"):
        found.append(
            finding(
                "GA104",
                WARNING,
                "sensitive_keys",
                "sensitive_keys is empty: secrets and personal data are not refused at publish",
                "remove sensitive_keys from the guardrails settings, or list the names to refuse",
            )
        )
    for task in guarded:
        if task_attribute(task, "max_payload_bytes") is not None and not resolve(task, "max_payload_bytes", {}):
            found.append(
                finding(
                    "GA102",
                    WARNING,
                    task.name,
                    "max_payload_bytes=0 on the task: any payload size is published and retained",
                    "remove max_payload_bytes from the task, or set a limit in bytes",
                )
            )
        if task_attribute(task, "sensitive_keys") is not None and not resolve(task, "sensitive_keys", {}):
            found.append(
                finding(
                    "GA104",
                    WARNING,
                    task.name,
                    "sensitive_keys=() on the task: secrets and personal data are not refused at publish",
                    "remove sensitive_keys from the task; name a sensitive argument with allow_sensitive_payload",
                )
            )
        reason = resolve(task, "allow_sensitive_payload", {})
        if reason:
            found.append(
                finding(
                    "GA103",
                    INFO,
                    task.name,
                    f"carries sensitive values (allow_sensitive_payload): {reason}",
                    "review the reason; send a reference to the secret instead when you can",
                )
            )
        version = resolve(task, "payload_version", {})
        accepted = resolve(task, "accepts_versions", {})
        if accepted is not None and version not in accepted:
            found.append(
                finding(
                    "GA105",
                    ERROR,
                    task.name,
                    f"payload_version {version} is not in accepts_versions {list(accepted)}: its workers "
                    "dead-letter every message its publishers send (unknown_payload_version)",
                    f"add {version} to accepts_versions",
                )
            )
    return found + redaction_rules(app, guarded)


def redaction_rules(app: Any, guarded: list[Any]) -> list[Finding]:
    """GA106, an empty ``redact_keys`` (app or task): the rule of :func:`celery_guardrails.options.weak_settings`,
    which the worker logs at start-up and ``manage.py check`` shows as guardrails.W003."""
    from celery_guardrails.options import app_settings, weak_settings

    return [
        finding(
            "GA106",
            WARNING,
            weakness.subject,
            weakness.message,
            "leave redact_keys unset for the defaults, or list the key-name fragments to redact",
        )
        for weakness in weak_settings(app_settings(app), guarded)
    ]
