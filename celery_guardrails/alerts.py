"""Owner alerts: a dead letter nobody hears about is silent data loss.

Each new dead letter (the ``dead_lettered`` signal, sent once the record is durable) alerts its owner
through ``alert_channels``: ``"log"`` (an ERROR line), ``"mail"`` (Django's mail to ``owner_emails[owner]``,
else ``ADMINS``) and ``"webhook"`` (a JSON POST to each of ``alert_webhooks``, ``alert_timeout`` seconds at
most). Receivers of ``dead_lettered`` are a channel of their own.

Throttling, shared by every worker through the store: per (owner, task, reason), the first dead letter of an
``alert_throttle`` window alerts at once; the others in that window are counted, and one summary with the
count is sent when the window is over (by the next dead letter, by the worker's guardrails timer, or by
:func:`flush_alert_summaries`). A flood of ten thousand failures sends one alert and one summary.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any

from celery_guardrails import clock, signals
from celery_guardrails.options import app_value
from celery_guardrails.outcomes import FinalFailure
from celery_guardrails.stores import get_store

logger = logging.getLogger(__name__)


def group_of(failure: FinalFailure) -> str:
    return f"{failure.owner or '-'}|{failure.task_name}|{failure.reason}"


def _on_dead_lettered(sender: Any = None, failure: FinalFailure | None = None, **_: Any) -> None:
    if sender is None or failure is None:
        return
    try:
        app = sender.app
        flush_alert_summaries(app)
        if get_store(app).throttle(group_of(failure), window=app_value(app, "alert_throttle"), now=clock.now(app)):
            send(app, subject=f"Dead letter: {failure.task_name} ({failure.reason})", failure=failure)
    except Exception:  # an alert must never fail the task or lose the ack
        logger.exception("Alert for dead letter %s could not be sent", getattr(failure, "task_id", None))


def flush_alert_summaries(app: Any) -> int:
    """Send the summaries of throttle windows that are over; how many were sent."""
    due = get_store(app).due_summaries(now=clock.now(app))
    for group, count in due:
        owner, task_name, reason = group.split("|", 2)
        send(
            app,
            subject=f"{count} more dead letter(s): {task_name} ({reason})",
            summary={
                "owner": None if owner == "-" else owner,
                "task_name": task_name,
                "reason": reason,
                "count": count,
                "window_seconds": app_value(app, "alert_throttle"),
            },
        )
    return len(due)


def send(
    app: Any,
    *,
    subject: str,
    failure: FinalFailure | None = None,
    summary: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
    owner: str | None = None,
) -> None:
    """Alert through every ``alert_channels``: about a dead letter, a throttle summary or a scheduled run."""
    owner = failure.owner if failure else (summary or {}).get("owner", owner)
    payload: dict[str, Any] = {"subject": subject, "owner": owner}
    if run is not None:
        payload["run"] = run
    if failure is not None:
        payload["dead_letter"] = {
            k: getattr(failure, k)
            for k in (
                "task_name",
                "task_id",
                "reason",
                "exc_type",
                "exc_message",
                "tenant",
                "correlation_id",
                "attempts",
                "last_failed_at",
            )
        }
    if summary is not None:
        payload["summary"] = summary
    for channel in app_value(app, "alert_channels"):
        try:
            if channel == "log":
                logger.error("ALERT for %s: %s %s", owner or "nobody", subject, json.dumps(payload, default=str))
            elif channel == "mail":
                _mail(app, owner, subject, payload)
            elif channel == "webhook":
                for url in app_value(app, "alert_webhooks"):
                    _post(url, payload, timeout=app_value(app, "alert_timeout"))
        except Exception:
            logger.exception("Alert channel %s failed for %s", channel, subject)


def _mail(app: Any, owner: str | None, subject: str, payload: dict[str, Any]) -> None:
    if not _django_configured():
        # The default channels include mail; a deployment without Django has nothing to send it with.
        logger.warning("No Django settings: alert '%s' not mailed (remove 'mail' from alert_channels)", subject)
        return
    from django.conf import settings
    from django.core.mail import send_mail

    admins: list[tuple[str, str]] = list(getattr(settings, "ADMINS", []))
    recipients = list(app_value(app, "owner_emails").get(owner or "", ())) or [admin[1] for admin in admins]
    if not recipients:
        logger.warning("No address for owner %s and no ADMINS: alert '%s' not mailed", owner, subject)
        return
    send_mail(
        f"[guardrails] {subject}",
        json.dumps(payload, indent=2, default=str),
        getattr(settings, "SERVER_EMAIL", None),
        recipients,
    )


def _django_configured() -> bool:
    try:
        from django.conf import settings
    except ImportError:
        return False
    return bool(settings.configured)


def _post(url: str, payload: dict[str, Any], *, timeout: float) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(payload, default=str).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


signals.dead_lettered.connect(_on_dead_lettered, weak=False, dispatch_uid="celery_guardrails.alerts")
