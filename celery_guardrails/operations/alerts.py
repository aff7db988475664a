"""Owner alerts: a dead letter nobody hears about is silent data loss.

Each new dead letter (the ``dead_lettered`` signal, sent once the record is durable) alerts its owner
through ``alert_channels``: ``"log"`` (an ERROR line), ``"mail"`` (Django's mail to ``owner_emails[owner]``,
else ``ADMINS``) and ``"webhook"`` (a JSON POST to each of ``alert_webhooks``, ``alert_timeout`` seconds at
most). Receivers of ``dead_lettered`` are a channel of their own.

Throttling, shared by every worker through the store: per (owner, task, reason), the first dead letter of an
``alert_throttle`` window alerts at once; the others in that window are counted, and one summary with the
count is sent when the window is over (by the next dead letter, by the worker's guardrails timer, or by
:func:`flush_alert_summaries`). A flood of ten thousand failures sends one alert and one summary.

Missed and overdue scheduled runs are throttled per (owner, schedule, kind) with ``run_alert_throttle``: the
first alerts at once; each later one is counted and pushes the window's end (an outage that goes on stays one
incident), for at most :data:`RUN_ALERT_WINDOWS` windows; the summary says how many more periods there were.
A beat outage of ten periods sends one alert and one summary per schedule. The ``run_missed`` and
``run_overdue`` signals are still sent once per period.

An ordering key whose messages wait for a missing earlier one for ``ordering_gap_alert_after`` alerts its
task's owner once per wait (:func:`ordering_wait`; the store lets one waiter through), throttled per (owner,
task) with ``alert_throttle`` like dead letters: many keys stuck at once send one alert, then one summary.

Redacted: the subject and every text of the payload lose their secrets as a dead letter's do (the task's
``redact_keys`` and ``redact_patterns``, else the app's: :mod:`celery_guardrails.foundation.redaction`), whatever the
alert is about and wherever its text came from (a header-carried record, a schedule's run), before any
channel sees them.

Off the ack path: mail and webhooks go out from one sender thread per process, tried three times, and an
unreachable channel is left alone for ``alert_throttle`` seconds after one warning line
(:mod:`celery_guardrails.operations.alert_channels`, which writes on this module's logger).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from celery_guardrails import signals
from celery_guardrails.foundation import clock
from celery_guardrails.foundation.redaction import Redactor, for_app, safe_repr
from celery_guardrails.log import moment_text
from celery_guardrails.operations.alert_channels import ALERT_CHANNELS, deliver

# Re-exported: read here before the channels had a module of their own. RETRY_PAUSES is not: patch it where the
# sender reads it (alert_channels), since a patched copy here would change nothing.
from celery_guardrails.operations.alert_channels import DRAIN_SECONDS as DRAIN_SECONDS
from celery_guardrails.operations.alert_channels import MAX_PENDING as MAX_PENDING
from celery_guardrails.operations.alert_channels import SENDER as SENDER
from celery_guardrails.operations.alert_channels import Delivery as Delivery
from celery_guardrails.operations.alert_channels import Outage as Outage
from celery_guardrails.operations.alert_channels import Sender as Sender
from celery_guardrails.options import APP, Option, app_value, checks, declare
from celery_guardrails.runtime.delivery import redaction, view
from celery_guardrails.runtime.final_failure import FinalFailure
from celery_guardrails.runtime.outcomes import owner_of
from celery_guardrails.stores import get_store

logger = logging.getLogger(__name__)


def _channels(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else None
    if items is None:
        raise ValueError(f"must be a list of channels (known: {', '.join(ALERT_CHANNELS)}), got {value!r:.80}")
    for item in items:
        if item not in ALERT_CHANNELS:
            raise ValueError(f"unknown channel {item!r:.80}; known: {', '.join(ALERT_CHANNELS)}")
    return tuple(items)


def _webhooks(value: Any) -> tuple[str, ...]:
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list | tuple):
        raise ValueError(f"must be a list of http:// or https:// URLs, got {checks.kind(value)}")
    for number, url in enumerate(urls, start=1):
        # Not shown: a webhook URL is often its own secret (a Slack or Teams URL is the credential).
        if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", url):
            raise ValueError(f"webhook {number} is not an http:// or https:// URL (not shown: it may hold a secret)")
    return tuple(urls)


def _owner_emails(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map owner names to lists of mail addresses, got {checks.kind(value)}")
    checked = {}
    for owner, addresses in value.items():
        try:
            checks.name(owner)
        except ValueError as exc:
            raise ValueError(f"the owner {exc}") from None
        items = [addresses] if isinstance(addresses, str) else addresses  # one address (a str was spelled out)
        if not isinstance(items, list | tuple) or not all(
            isinstance(a, str) and re.fullmatch(r"[^@\s]+@[^@\s]+", a) for a in items
        ):
            raise ValueError(f"owner {owner!r}: must be a mail address or a list of them")
        checked[owner] = tuple(items)
    return checked


#: The options the alerts read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="alert_channels",
        default=("log", "mail"),
        doc="How owners hear of dead letters: 'log', 'mail' (Django), 'webhook' (alert_webhooks); another "
        "name is an error.",
        check=_channels,
        scopes=frozenset({APP}),
    ),
    Option(
        name="alert_webhooks",
        default=(),
        doc="http:// or https:// URLs that receive each alert as a JSON POST (an error never shows them).",
        check=_webhooks,
        scopes=frozenset({APP}),
    ),
    Option(
        name="alert_timeout",
        default=5.0,
        doc="Seconds a webhook may take.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="alert_throttle",
        default=300.0,
        doc="Seconds of a throttle window per (owner, task, reason): one alert, then one summary. Also how "
        "long a process leaves an unreachable alert channel alone after its one warning line.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="run_alert_throttle",
        default=300.0,
        doc="Seconds: missed and overdue runs of one schedule alert its owner once, then are counted while "
        "they go on (each pushes the window's end this far, up to 12 windows after the alert) and summed up in "
        "one summary when they stop. 0: an alert for every period.",
        check=checks.seconds_or_off,
        scopes=frozenset({APP}),
    ),
    Option(
        name="owner_emails",
        default={},
        doc="Mail addresses per owner: {'payments': ['pay-oncall@example.com']} (else ADMINS).",
        check=_owner_emails,
        scopes=frozenset({APP}),
    ),
)


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


#: A schedule's run alerts are counted for at most this many ``run_alert_throttle`` windows after the alert
#: that opened them: an outage that goes on gets a summary (and, next, an alert) about once an hour.
RUN_ALERT_WINDOWS = 12
#: Reason part of the throttle group of run alerts: ``owner|schedule|run_missed`` or ``...|run_overdue``.
RUN_ALERT = "run_"


def run_alert_due(app: Any, *, owner: str | None, schedule: str, kind: str) -> bool:
    """Whether a missed or overdue run of ``schedule`` alerts now (False: counted for the summary)."""
    window = app_value(app, "run_alert_throttle")
    if not window:
        return True
    group = f"{owner or '-'}|{schedule}|{RUN_ALERT}{kind}"
    return get_store(app).throttle(group, window=window, now=clock.now(app), extend_for=window * RUN_ALERT_WINDOWS)


#: Reason part of the throttle group of ordering waits: ``owner|task|ordering_wait``.
ORDERING_WAIT = "ordering_wait"


def ordering_wait(task: Any, *, key: str, waiting_for: int, lowest: int, since: float) -> None:
    """Alert the task's owner that ordering ``key`` has waited for sequence number ``waiting_for`` since ``since``
    (epoch seconds) for ``ordering_gap_alert_after``. Sent once per wait (the store decides); throttled per
    (owner, task) like dead letters, so a thousand keys stuck at once send one alert and one summary. Never
    raises: an alert must not hold the message."""
    try:
        app = task.app
        owner = owner_of(task)
        flush_alert_summaries(app)
        group = f"{owner or '-'}|{task.name}|{ORDERING_WAIT}"
        if not get_store(app).throttle(group, window=app_value(app, "alert_throttle"), now=clock.now(app)):
            return
        opened = datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
        about = {
            "task_name": task.name,
            "key": key,
            "waiting_for": waiting_for,
            "lowest_waiting": lowest,
            "since": opened,
            "waited_seconds": round(max(0.0, time.time() - since), 1),
            "gives_up_after_seconds": view(task).options["ordering_gap_timeout"],
        }
        subject = f"Ordering key waits: {key} waits for #{waiting_for} since {moment_text(since)}"
        send(app, subject=subject, owner=owner, ordering=about)
    except Exception:
        logger.exception("Alert for the wait of ordering key %s could not be sent", key)


def flush_alert_summaries(app: Any) -> int:
    """Send the summaries of throttle windows that are over; how many were sent."""
    due = get_store(app).due_summaries(now=clock.now(app))
    for group, count in due:
        owner, rest = group.split("|", 1)
        name, reason = rest.rsplit("|", 1)  # a schedule's name may hold "|"; an owner's and a reason's do not
        if reason == ORDERING_WAIT:  # ordering keys of a task that waited past ordering_gap_alert_after
            subject = f"{count} more ordering key(s) waiting: {name}"
            about = {"task_name": name, "kind": ORDERING_WAIT, "window_seconds": app_value(app, "alert_throttle")}
        elif reason.startswith(RUN_ALERT):  # missed or overdue runs of a schedule
            kind = reason.removeprefix(RUN_ALERT)
            subject = f"{count} more {kind} run(s): {name}"
            about = {"schedule": name, "kind": kind, "window_seconds": app_value(app, "run_alert_throttle")}
        else:  # dead letters of a task
            subject = f"{count} more dead letter(s): {name} ({reason})"
            about = {"task_name": name, "reason": reason, "window_seconds": app_value(app, "alert_throttle")}
        send(app, subject=subject, summary={"owner": None if owner == "-" else owner, "count": count, **about})
    return len(due)


def send(
    app: Any,
    *,
    subject: str,
    failure: FinalFailure | None = None,
    summary: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
    owner: str | None = None,
    ordering: dict[str, Any] | None = None,
) -> None:
    """Alert through every ``alert_channels``: about a dead letter, a throttle summary, a scheduled run or an
    ordering key's wait."""
    owner = failure.owner if failure else (summary or {}).get("owner", owner)
    payload: dict[str, Any] = {"subject": subject, "owner": owner}
    if run is not None:
        payload["run"] = run
    if ordering is not None:
        payload["ordering"] = ordering
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
    redactor = _redactor(app, failure)
    subject = redactor.text(subject)
    # As the channels write it (times as text), then redacted value by value.
    payload = redactor.shown(json.loads(json.dumps(payload, default=_as_text))).value
    for channel in app_value(app, "alert_channels"):
        try:  # one channel that fails (mail settings, say) must not silence the others
            deliver(app, channel, owner=owner, subject=subject, payload=payload)
        except Exception:
            logger.exception("Alert channel %s failed for %s", channel, subject)


def _redactor(app: Any, failure: FinalFailure | None) -> Redactor:
    """The redaction of the failed task (its own ``redact_keys`` and ``redact_patterns``), else the app's."""
    try:
        task = app.tasks.get(failure.task_name) if failure is not None else None
    except Exception:  # an app that cannot list its tasks: its own settings still apply
        task = None
    return redaction(task) if task is not None else for_app(app)


signals.dead_lettered.connect(_on_dead_lettered, weak=False, dispatch_uid="celery_guardrails.operations.alerts")


def _as_text(value: Any) -> str:
    """A value JSON has no type for, as an alert shows it: its ``str`` (a time as 2027-01-15 08:00:00+00:00); its
    bounded repr when ``str`` raises (one value must not lose the alert on every channel)."""
    try:
        return str(value)
    except Exception:
        return safe_repr(value)
