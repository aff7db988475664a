"""The dead-letter ownership axis (GA4xx): a dead letter nobody hears about is silent data loss. A guarded task
with no owner (:func:`owner_rules`, also the worker's start-up warning), alert channels that tell nobody (only
``log``, a ``webhook`` with no URL, ``mail`` with no address), and no ``seal_keys`` to replay a dead letter
whose secrets were redacted.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations.audit.model import WARNING, Finding, finding
from celery_guardrails.options import app_value


def _mail_recipients_missing(app: Any, guarded: list[Any]) -> str | None:
    """Why mail alerts reach nobody, or None when they reach someone."""
    from celery_guardrails.operations.alert_channels import django_configured
    from celery_guardrails.runtime.outcomes import owner_of

    if not django_configured():
        return "there are no Django settings to send mail with"
    from django.conf import settings

    if list(getattr(settings, "ADMINS", None) or ()):
        return None
    addresses = app_value(app, "owner_emails")
    owners = {owner_of(task) or "" for task in guarded}
    # (an entry opted out, schedules[name] = None, has no policy: no owner to tell of its runs)
    policies = app_value(app, "schedules").values()
    owners |= {policy.owner for policy in policies if policy is not None and policy.owner}
    missing = sorted(owner or "(no owner)" for owner in owners if not addresses.get(owner))
    if not missing:
        return None
    return f"no ADMINS, and no owner_emails for {', '.join(missing)}"


def owner_rules(guarded: list[Any]) -> list[Finding]:
    """GA401, a guarded task with no owner: the audit's finding, and the worker's start-up warning
    (:func:`celery_guardrails.runtime.install.warn_about` names them all on one line)."""
    from celery_guardrails.runtime.outcomes import owner_of

    return [
        finding(
            "GA401",
            WARNING,
            task.name,
            "no owner: its dead letters alert nobody in particular",
            f'set owner="<team>" on the task, or an owners pattern such as {{"{task.name.rsplit(".", 1)[0]}.*": '
            '"<team>"}',
        )
        for task in guarded
        if owner_of(task) is None
    ]


def dead_letter_rules(app: Any, guarded: list[Any]) -> list[Finding]:
    """Dead-letter ownership (GA4xx): the owner rule, alert channels that reach nobody, and no seal keys."""
    found = owner_rules(guarded)
    channels = tuple(app_value(app, "alert_channels"))
    if not set(channels) - {"log"}:
        found.append(
            finding(
                "GA402",
                WARNING,
                "alert_channels",
                f"alert_channels is {list(channels)}: a dead letter is at most a log line nobody is paged for",
                'add "mail" (owner_emails or ADMINS) or "webhook" (alert_webhooks)',
            )
        )
    if "webhook" in channels and not app_value(app, "alert_webhooks"):
        found.append(
            finding(
                "GA403",
                WARNING,
                "alert_webhooks",
                '"webhook" is an alert channel but alert_webhooks is empty: no alert is posted',
                "set alert_webhooks to the URLs that take the alerts",
            )
        )
    if "mail" in channels:
        why = _mail_recipients_missing(app, guarded)
        if why:
            found.append(
                finding(
                    "GA404",
                    WARNING,
                    "owner_emails",
                    f'"mail" is an alert channel but {why}: no alert is mailed',
                    "set owner_emails per owner, or ADMINS",
                )
            )
    if not app_value(app, "seal_keys"):
        found.append(
            finding(
                "GA405",
                WARNING,
                "seal_keys",
                "no seal_keys: a dead letter whose arguments had a secret redacted cannot be replayed",
                "set seal_keys to Fernet keys read from the environment",
            )
        )
    return found
