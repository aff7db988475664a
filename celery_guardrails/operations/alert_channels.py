"""How an alert goes out, once :mod:`celery_guardrails.operations.alerts` has decided to send it (throttled,
redacted): the ``log`` channel (an ERROR line), ``mail`` (Django's mail to ``owner_emails[owner]``, else
``ADMINS``) and ``webhook`` (a JSON POST to each of ``alert_webhooks``), through :func:`deliver`.

Off the ack path: the ``log`` channel writes at once; mail and webhooks are handed to one sender thread per
process (:class:`Sender`), so a slow SMTP server or webhook never holds a message's ack. Each delivery is
tried three times (1 s, then 2 s apart); at most :data:`MAX_PENDING` wait (more are logged and dropped);
what is still waiting when the worker or beat stops gets :data:`DRAIN_SECONDS` to go out.

An unreachable channel (nothing listens on the SMTP port, the webhook's host is down or unknown, a connect
timeout) is an outage, not a bug: after its three tries it logs ONE warning line, with no traceback (the
channel, the error's class and message, when it is tried again), and the process leaves that channel alone for
``alert_throttle`` seconds (the window that throttles alerts): its alerts in that time are counted and dropped
(the dead letters keep their records, and the ``log`` channel still writes each alert). The first delivery after
the pause tries again; when it goes out, one line says the channel is back and how many alerts it missed. Any
other failure (a refused login, an HTTP 500) is logged with its traceback after the third try. This is per
process: each prefork child says it once.

The lines this module writes are on the ``celery_guardrails.operations.alerts`` logger, as before the
channels had a module of their own: one logger for everything about alerts.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown

from celery_guardrails.options import app_value

# The alerts' logger, not this module's name: logging configs and filters that name the alerts' logger keep
# every line about an alert, its delivery included.
logger = logging.getLogger("celery_guardrails.operations.alerts")

#: The alert channels there are (:func:`deliver` handles each).
ALERT_CHANNELS = ("log", "mail", "webhook")


def deliver(app: Any, channel: str, *, owner: str | None, subject: str, payload: dict[str, Any]) -> None:
    """Hand one alert (its ``subject`` and ``payload`` already redacted) to ``channel``: the log line at once, mail
    and webhooks to the process's sender thread (:data:`SENDER`)."""
    if channel == "log":
        logger.error("ALERT for %s: %s %s", owner or "nobody", subject, json.dumps(payload, default=str))
    elif channel == "mail":
        _mail(app, owner, subject, payload)
    elif channel == "webhook":
        for url in app_value(app, "alert_webhooks"):
            timeout = app_value(app, "alert_timeout")
            SENDER.submit(
                f"webhook {url} of {subject!r}",
                _post,
                url,
                payload,
                timeout,
                channel=f"webhook {url}",
                pause=app_value(app, "alert_throttle"),
            )


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the channel's server could not be reached (an outage: one warning line), rather than
    that it answered with a refusal (a bug or a setting to fix: a traceback)."""
    import smtplib
    import urllib.error

    if isinstance(exc, urllib.error.HTTPError):  # the server answered (a 4xx/5xx)
        return False
    if isinstance(exc, urllib.error.URLError):  # refused, DNS, timeout: urllib wraps the OSError
        return True
    if isinstance(exc, smtplib.SMTPConnectError | smtplib.SMTPServerDisconnected):
        return True
    if isinstance(exc, smtplib.SMTPException):  # a refused login or recipient: the server is there
        return False
    return isinstance(exc, OSError)  # ConnectionRefusedError, TimeoutError, socket.gaierror, no route


#: Deliveries waiting at most, per process; more are logged and dropped.
MAX_PENDING = 1000
#: Seconds what is still waiting gets when the process stops.
DRAIN_SECONDS = 10.0
#: Pauses between the tries of one delivery (seconds): three tries in all.
RETRY_PAUSES = (1.0, 2.0)


@dataclass(slots=True, kw_only=True)
class Outage:
    """A channel this process found unreachable: left alone until ``until`` (epoch seconds)."""

    until: float
    skipped: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One alert to send through one channel (``mail``, ``webhook <url>``)."""

    what: str
    channel: str
    deliver: Callable[..., Any]
    args: tuple[Any, ...]
    pause: float  # alert_throttle: how long an unreachable channel is left alone
    hint: str = ""  # said once with the outage's warning (how to get rid of it in development)


class Sender:
    """One daemon thread per process that delivers alerts (mail, webhooks) off the task's path."""

    def __init__(self) -> None:
        self.pending: queue.Queue[Delivery] = queue.Queue(MAX_PENDING)
        self.pid = 0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.outages: dict[str, Outage] = {}  # channels found unreachable (only the sender thread touches it)

    def submit(
        self,
        what: str,
        deliver: Callable[..., Any],
        *args: Any,
        channel: str = "alert",
        pause: float = 300.0,
        hint: str = "",
    ) -> None:
        with self.lock:
            if self.pid != os.getpid():  # first use, or a forked pool child: the parent's thread is not here
                self.pid = os.getpid()
                self.pending = queue.Queue(MAX_PENDING)
                self.outages = {}
                self.thread = threading.Thread(target=self._run, name="guardrails-alerts", daemon=True)
                self.thread.start()
        try:
            self.pending.put_nowait(
                Delivery(what=what, channel=channel, deliver=deliver, args=args, pause=pause, hint=hint)
            )
        except queue.Full:
            logger.error("Alert %s dropped: %d alerts are already waiting to be sent", what, MAX_PENDING)

    def _run(self) -> None:
        while True:
            item = self.pending.get()
            try:
                outage = self.outages.get(item.channel)
                if outage is not None and time.time() < outage.until:
                    outage.skipped += 1  # said when the channel is back: no line per alert during an outage
                    continue
                self._deliver(item)
            except Exception:  # the thread must live on whatever one delivery does
                logger.exception("Alert %s: the sender failed", item.what)
            finally:
                self.pending.task_done()

    def _deliver(self, item: Delivery) -> None:
        for pause in (*RETRY_PAUSES, None):
            try:
                item.deliver(*item.args)
            except Exception as exc:
                if pause is not None:
                    # One line per delivery at most, at the end: three tracebacks per alert was the noise.
                    logger.debug(
                        "Alert %s not sent (%s: %s); trying again in %gs", item.what, type(exc).__name__, exc, pause
                    )
                    time.sleep(pause)
                elif _unreachable(exc):
                    self._down(item, exc)
                else:
                    logger.exception("Alert %s could not be sent (3 tries)", item.what)
            else:
                outage = self.outages.pop(item.channel, None)
                if outage is not None:
                    logger.warning(
                        "Alert channel %s is reachable again; %d alert(s) were not sent while it was not",
                        item.channel,
                        outage.skipped,
                    )
                return

    def _down(self, item: Delivery, exc: BaseException) -> None:
        from celery_guardrails.log import when

        retry_at = time.time() + item.pause
        self.outages[item.channel] = Outage(until=retry_at)
        logger.warning(
            "Alert channel %s unreachable (%s: %s): alert %s not sent; its alerts until %s are dropped (the dead "
            "letters keep their records), then it is tried again%s",
            item.channel,
            type(exc).__name__,
            exc,
            item.what,
            when(retry_at),
            f". {item.hint}" if item.hint else "",
        )

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Wait for what is queued to go out (at most ``timeout`` seconds); whether it all did."""
        if self.thread is None or self.pid != os.getpid() or not self.thread.is_alive():
            return True
        deadline = time.monotonic() + timeout
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pending.unfinished_tasks:
            logger.error("%d alert(s) not sent before the process stopped", self.pending.unfinished_tasks)
            return False
        return True


SENDER = Sender()


def _drain(**_: Any) -> None:
    SENDER.drain()


def _mail(app: Any, owner: str | None, subject: str, payload: dict[str, Any]) -> None:
    """Work out the mail here (who gets it, or why nobody does); only the sending goes to the sender thread,
    which may run while the process stops (no imports there)."""
    if not django_configured():
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
    mail = (
        f"[guardrails] {subject}",
        json.dumps(payload, indent=2, default=str),
        getattr(settings, "SERVER_EMAIL", None),
        recipients,
    )
    backend = str(getattr(settings, "EMAIL_BACKEND", ""))
    smtp = backend == "django.core.mail.backends.smtp.EmailBackend"
    where = f" (SMTP {getattr(settings, 'EMAIL_HOST', '')}:{getattr(settings, 'EMAIL_PORT', '')})" if smtp else ""
    hint = (
        "In development, set EMAIL_BACKEND = 'django.core.mail.backends.console.EmailBackend' (alerts printed) "
        "or remove 'mail' from alert_channels"
        if smtp and getattr(settings, "DEBUG", False)
        else ""
    )
    SENDER.submit(
        f"mail of {subject!r}",
        send_mail,
        *mail,
        channel=f"mail{where}",
        pause=app_value(app, "alert_throttle"),
        hint=hint,
    )


def django_configured() -> bool:
    try:
        from django.conf import settings
    except ImportError:
        return False
    return bool(settings.configured)


def _post(url: str, payload: dict[str, Any], timeout: float) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(payload, default=str).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


# A stopping worker (each prefork child, and the main process) and beat let queued alerts go out first.
worker_process_shutdown.connect(_drain, weak=False, dispatch_uid="celery_guardrails.operations.alerts.child")
worker_shutdown.connect(_drain, weak=False, dispatch_uid="celery_guardrails.operations.alerts.worker")
atexit.register(SENDER.drain)
