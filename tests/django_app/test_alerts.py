"""Owners hear of dead letters once, then in a summary: mail (locmem) and a webhook to a local server."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis
from celery import group
from django.core import mail
from django.db import connection

from celery_guardrails.operations import alert_channels, alerts
from celery_guardrails.operations.alerts import flush_alert_summaries
from celery_guardrails.stores.redis import ALERT_PENDING, ALERT_PREFIX
from tests.proj import django_tasks
from tests.support.services import REDIS_URL
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


# Past the suite's 120 s: the flood's own join allows 180 s, and 500 dead letters on two cores shared with the other
# test processes took 105 s in one run and over 120 s in the next.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("store", "flood"), [("redis", 500), ("django", 50)])
def test_first_dead_letter_alerts_then_a_flood_makes_one_summary(
    celery_worker: Any,
    celery_app: Any,
    webhook: tuple[str, list[dict[str, Any]]],
    store: str,
    flood: int,
) -> None:
    if store == "redis" and connection.vendor == "sqlite":
        pytest.skip("the Redis store's flood, once is enough (runs in the PostgreSQL pass)")
    url, posted = webhook
    # The throttle reads the guardrails' clock, which stands still here until the test moves it: the flood
    # is inside the window however long it takes on a busy machine.
    clock = [time.time()]
    # (Long, though: the Redis store's keys also expire on the Redis server's own clock, after the window; a
    # flood of 500 on a machine shared with another test process can take over a minute.)
    window = 900.0
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "dead_letter_sinks": ["django"],
        "alert_channels": ["log", "mail", "webhook"],
        "alert_webhooks": [url],
        "alert_throttle": window,
        "owner_emails": {"payments": ["pay@example.com"]},
        "clock": lambda: clock[0],
        **({"store": "django"} if store == "django" else {}),
    }
    # A fresh throttle window for this group (other tests dead-letter the same task, and Redis outlives runs)
    group_key = "payments|tests.proj.django_tasks.fail_with|permanent"
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(ALERT_PREFIX + group_key)
    client.srem(ALERT_PENDING, group_key)
    flush_alert_summaries(celery_app)
    mail.outbox.clear()
    # Given the first dead letter of owner "payments"
    first = django_tasks.fail_with.delay("permanent")
    with pytest.raises(Exception, match="card refused"):
        first.get(timeout=30)
    # Then one mail and one webhook, sent off the task's path (other tests' groups may flush their own
    # summaries meanwhile: only this group's alerts are counted)
    wait_for("the first alert", lambda: ours(mail.outbox) and ours_posted(posted))
    assert [m.to for m in ours(mail.outbox)] == [["pay@example.com"]]
    assert "Dead letter: tests.proj.django_tasks.fail_with (permanent)" in ours(mail.outbox)[0].subject
    assert [p["dead_letter"]["task_id"] for p in ours_posted(posted)] == [first.id]
    # When many more fail within the throttle window
    group(django_tasks.fail_with.s("permanent") for _ in range(flood)).delay().join(timeout=180, propagate=False)
    assert len(ours(mail.outbox)) == 1 and len(ours_posted(posted)) == 1
    flush_alert_summaries(celery_app)
    assert len(ours(mail.outbox)) == 1, "no summary before the window is over"
    # Then, once the window is over, one summary with the count (sent by this flush or by the worker's
    # watchdog thread, which flushes too: whichever takes the window's count sends it)
    clock[0] += window + 1
    flush_alert_summaries(celery_app)
    mails = wait_for("the summary", lambda: ours(mail.outbox) if len(ours(mail.outbox)) >= 2 else None)
    assert len(mails) == 2 and f"{flood} more dead letter(s)" in mails[1].subject
    posts = wait_for("the summary's webhook", lambda: ours_posted(posted) if len(ours_posted(posted)) >= 2 else None)
    assert len(posts) == 2 and posts[-1]["summary"]["count"] == flood
    flush_alert_summaries(celery_app)
    assert len(ours(mail.outbox)) == 2


def ours(outbox: list[Any]) -> list[Any]:
    return [m for m in outbox if "tests.proj.django_tasks.fail_with (permanent)" in m.subject]


def ours_posted(posted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def about(p: dict[str, Any]) -> tuple[str, str]:
        item = p.get("dead_letter") or p.get("summary") or {}
        return item.get("task_name", ""), item.get("reason", "")

    return [p for p in posted if about(p) == ("tests.proj.django_tasks.fail_with", "permanent")]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connecting to it is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_channel_logs_one_warning_per_outage_then_says_it_is_back(
    celery_worker: Any,
    celery_app: Any,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given ADMINS, the mail and webhook channels, Django's default SMTP backend, and nothing listening on the
    # SMTP port nor on the webhook's (a development machine: the "3 tracebacks per alert")
    smtp_port, hook_port = closed_port(), closed_port()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.DEBUG = "127.0.0.1", smtp_port, True
    settings.ADMINS = [("Ops", "ops@example.com")]
    url = f"http://127.0.0.1:{hook_port}/hooks/dead-letters"
    # (summaries other tests left due in the shared store go out first, on no channel, and what an earlier test
    # left queued to its own webhook is delivered or given up: neither is counted below)
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "alert_channels": []}
    flush_alert_summaries(celery_app)
    assert alerts.SENDER.drain(30)
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "alert_channels": ["mail", "webhook"],
        "alert_webhooks": [url],
        "alert_throttle": 3.0,  # also how long an unreachable channel is left alone
        "owner_emails": {},
    }
    group_key = "payments|tests.proj.django_tasks.fail_with|permanent"
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(ALERT_PREFIX + group_key)
    client.srem(ALERT_PENDING, group_key)
    monkeypatch.setattr(alert_channels, "RETRY_PAUSES", (0.05, 0.05))  # the three tries, quicker
    caplog.set_level(logging.DEBUG, logger="celery_guardrails.operations.alerts")
    # When a real worker dead-letters a message (its owner alerted), and three more alerts follow at once
    with pytest.raises(Exception, match="card refused"):
        django_tasks.fail_with.delay("permanent").get(timeout=30)
    channels = {f"mail (SMTP 127.0.0.1:{smtp_port})", f"webhook {url}"}
    wait_for(
        "the dead letter's alert tried on both channels", lambda: channels <= alerts.SENDER.outages.keys(), timeout=30
    )
    for n in range(3):
        alerts.send(celery_app, subject=f"Run missed: nightly #{n}", run={"schedule": "nightly"}, owner="payments")
    assert alerts.SENDER.drain(10)
    # Then each channel logged ONE warning line, without a traceback: the channel, the error's class and
    # message, the time it is tried again; and the mail's line says what development setups use instead
    said = [r for r in caplog.records if r.name == "celery_guardrails.operations.alerts" and r.levelno >= logging.INFO]
    assert [(r.levelname, r.exc_info, r.exc_text) for r in said] == [("WARNING", None, None)] * 2, [
        r.getMessage() for r in said
    ]
    by_channel = {r.getMessage().split(" unreachable")[0]: r.getMessage() for r in said}
    assert sorted(by_channel) == sorted(
        [f"Alert channel mail (SMTP 127.0.0.1:{smtp_port})", f"Alert channel webhook {url}"]
    )
    for line in by_channel.values():
        assert "(ConnectionRefusedError: [Errno 111] Connection refused)" in line or "Connection refused" in line
        assert re.search(r"until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in \d\.\d s\)", line), line
        assert "then it is tried again" in line
    assert (
        "EMAIL_BACKEND = 'django.core.mail.backends.console.EmailBackend'"
        in by_channel[f"Alert channel mail (SMTP 127.0.0.1:{smtp_port})"]
    )
    # When the webhook's server comes up and, the pause over, another alert is sent
    caplog.clear()
    posted: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            posted.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", hook_port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_for(
            "the end of the channels' pause",
            lambda: time.time() > max(o.until for o in alerts.SENDER.outages.values()) or None,
            timeout=10,
        )
        alerts.send(celery_app, subject="Run missed: nightly #4", run={"schedule": "nightly"}, owner="payments")
        assert alerts.SENDER.drain(10)
    finally:
        server.shutdown()
        server.server_close()
    # Then the webhook got it, and says it is back with the three alerts it missed; the mail, still down, logged
    # its second outage's one line
    assert len(posted) == 1
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "celery_guardrails.operations.alerts" and r.levelno >= logging.INFO
    ]
    assert sorted(line.split(" (")[0].split(";")[0] for line in said) == sorted(
        [
            "Alert channel mail",
            f"Alert channel webhook {url} is reachable again",
        ]
    ), said
    assert any(
        re.fullmatch(
            f"Alert channel webhook {re.escape(url)} is reachable again; 3 alert\\(s\\) were not sent while it was not",
            line,
        )
        for line in said
    ), said
