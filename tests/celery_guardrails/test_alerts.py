"""Alert channels without Django (the Django mail and webhook cases: tests/django_app/test_alerts.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.workers import ROOT

SCRIPT = """
import logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
from celery import Celery
from celery_guardrails.alerts import send
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
