"""Alert channels without Django, and what any alert says (the Django mail and webhook cases of real dead letters:
tests/django_app/test_alerts.py)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import uuid
from typing import Any

from celery_guardrails.log import RedactingFilter
from celery_guardrails.operations.alerts import send
from celery_guardrails.runtime.final_failure import FinalFailure
from tests.support import planted
from tests.support.planted import leaked
from tests.support.waiting import wait_for
from tests.support.workers import ROOT

SCRIPT = """
import logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
from celery import Celery
from celery_guardrails.operations.alerts import send
app = Celery("no-django", set_as_current=False)
app.conf.guardrails = {"store": os.environ["GUARDRAILS_TEST_REDIS_URL"]}  # alert_channels: ("log", "mail")
send(app, subject="Run missed: nightly", run={"schedule": "nightly"}, owner="ops")
print("sent")
"""


def test_the_default_mail_channel_without_django_warns_instead_of_failing() -> None:
    # Given a deployment without Django, on the default channels (log and mail)
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    # When an alert is sent
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    # Then it is logged, the mail channel says why it sent nothing, and nothing raised
    assert done.stdout.strip() == "sent"
    assert "ALERT for ops: Run missed: nightly" in done.stderr
    assert "No Django settings: alert 'Run missed: nightly' not mailed" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_alert_says_no_secret_whatever_its_text_came_from(
    celery_app: Any, webhook: tuple[str, list[dict[str, Any]]]
) -> None:
    from django.core import mail

    url, posted = webhook
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "alert_channels": ["log", "mail", "webhook"],
        "alert_webhooks": [url],
        "owner_emails": {"security": ["security@example.com"]},
    }
    # Given a failure whose text was never redacted (a record carried in a header by another producer) and a
    # schedule's run whose reason quotes an error
    task_id = str(uuid.uuid4())
    failure = FinalFailure(
        task_name="tests.proj.leaky.leak",
        task_id=task_id,
        reason="permanent",
        exc_type="tests.proj.leaky.LeakyError",
        exc_message=planted.MESSAGE,
        tenant=None,
        correlation_id=None,
        attempts=1,
        owner="security",
    )
    output = io.StringIO()
    handler = logging.StreamHandler(output)
    # The alert itself is checked: the logger's own redacting filter (celery_guardrails.log) is taken off meanwhile,
    # so that a log line the alert did not redact would show here.
    alerts_logger = logging.getLogger("celery_guardrails.operations.alerts")
    filters = [f for f in alerts_logger.filters if isinstance(f, RedactingFilter)]
    for kept in filters:
        alerts_logger.removeFilter(kept)
    alerts_logger.addHandler(handler)
    try:
        # When both are alerted through every channel
        send(celery_app, subject=f"Dead letter: {planted.STRIPE_KEY}", failure=failure)
        run = {"schedule": "nightly", "reason": planted.MESSAGE}
        send(celery_app, subject="Run missed: nightly", run=run, owner="security")
    finally:
        alerts_logger.removeHandler(handler)
        for kept in filters:
            alerts_logger.addFilter(kept)
    # Then the log line, the mails and the webhook's JSON say what happened, and none says a secret
    hooks = wait_for("both webhooks", lambda: posted if len(posted) >= 2 else None)

    def ours() -> list[Any] | None:
        sent = [m for m in mail.outbox if m.to == ["security@example.com"]]
        return sent if len(sent) >= 2 else None

    mails = wait_for("both mails", ours)
    assert [hook["dead_letter"]["task_id"] for hook in hooks if "dead_letter" in hook] == [task_id]
    assert "could not connect to postgresql://app:[redacted]@db/shop" in output.getvalue()
    for said in (output.getvalue(), hooks, [(m.subject, m.body) for m in mails]):
        assert leaked(said) == []
