"""The deployment audit: grade a Celery app's configuration and tasks against the background-jobs rubric.

:func:`audit` reads what can be checked without running anything: the app's config (``app.conf``), the
guardrails options (through :func:`~celery_guardrails.options.app_value` and
:func:`~celery_guardrails.options.resolve`, the one lookup rule) and the registered tasks, after the app's task
modules are imported as a worker imports them. It talks to no broker, store or database. Celery's own tasks
(``celery.*``) and the extension's (``django_celery_guardrails.*``: the prune task) are not graded: a finding
names something the project can change.

Seven axes, each scored from 5 down: a finding costs its axis 2 points when its severity is ``error`` (the
worker refuses to start, or messages are lost or refused by design), 1 when ``warning``, 0 when ``info`` (listed
for a reviewer: a deliberate, documented opt-out); a score never goes below 0. Every finding has a stable code:

message design
    GA101 warning  a task that is a plain ``celery.Task``, not a ``GuardedTask`` (no context, no retry gate, no
                   dead letter, no payload contract)
    GA102 warning  ``max_payload_bytes`` is 0 (app or task): any payload size is published
    GA103 info     ``allow_sensitive_payload``: the task carries sensitive values, and says why (listed with the
                   reason)
    GA104 warning  ``sensitive_keys`` is empty (app or task): secrets are not refused at publish
    GA105 error    a task's ``accepts_versions`` leaves out its own ``payload_version``: its workers dead-letter
                   every message its publishers send
idempotency enforced
    GA201 warning  a task retried on unknown and ambiguous errors (``idempotent=True`` or ``retry_unsafe``) with
                   no ``idempotency_key``: nothing stops two deliveries from both acting
retry policy with classification
    GA301 warning  ``retry_unsafe``: retried on ambiguous failures although not idempotent (listed)
    GA302 warning  a guarded task with ``acks_late`` off: acked before it ran
    GA303 warning  ``acks_late`` without ``reject_on_worker_lost`` (plain tasks too): a message whose worker
                   process dies is acked away instead of redelivered
    GA304 warning  a hard ``time_limit`` without ``soft_time_limit`` (guarded tasks): killed without a word
dead-letter ownership
    GA401 warning  a guarded task with no owner (``owner=`` or an ``owners`` pattern)
    GA402 warning  ``alert_channels`` empty or only ``"log"``: nobody is told of a dead letter
    GA403 warning  ``"webhook"`` in ``alert_channels`` with no ``alert_webhooks``
    GA404 warning  ``"mail"`` in ``alert_channels`` with nobody to mail: no Django settings, or owners with no
                   ``owner_emails`` entry and no ``ADMINS``
    GA405 warning  no ``seal_keys``: a dead letter whose arguments had a secret redacted cannot be replayed
ordering and concurrency
    GA501 warning  Redis broker: a task's ``backoff_max``, ``retry_later_delay * retry_later_max``, or (with
                   ``broker_lease`` off) ``time_limit`` is not shorter than the ``visibility_timeout``
                   (``broker_transport_options``, default 3600 s): the message is delivered twice
    GA502 warning  ``worker_prefetch_multiplier`` above 1 with tasks whose ``time_limit`` is unset or over 60 s:
                   messages wait behind a long task in a worker that holds them
    GA503 warning  ``ordering_key`` without ``idempotency_key``: a redelivered message of a key runs twice
scheduled work
    GA601 warning  a ``beat_schedule`` entry with no policy in ``schedules``: no stated timezone, overlap or
                   catch-up, no run ledger, no missed-run detection
    GA602 warning  a crontab entry whose policy states no ``timezone`` (nor its crontab): read in the app's zone
    GA603 warning  a scheduled entry nobody hears about: no policy ``owner`` and its task has none
    GA604 error    a policy for an entry that does not exist (the worker and beat refuse to start)
    GA605 error    a guarded entry whose task is registered and is not a ``GuardedTask`` (refused at start-up)
    GA606 info     ``watchdog`` off: missed runs are detected only if ``guardrails_watchdog`` runs from cron
observability
    GA701 warning  ``metrics`` off: no Prometheus metrics
    GA702 warning  ``activity`` off: no last-day activity for the dashboard's charts and the status rates
    GA703 warning  ``metrics`` on without prometheus-client installed: nothing can be recorded

The defaults are not findings where they are safe: ``overlap`` ("skip") and ``catch_up`` ("latest") always have
a value in a policy, so a policy is graded on its timezone and owner. Policies that name a django-celery-beat
row (not in ``beat_schedule``) are not read from the database here: their rows are assumed to exist when
django-celery-beat is installed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from celery.schedules import crontab

from celery_guardrails.options import app_value, resolve, task_attribute

ERROR = "error"
WARNING = "warning"
INFO = "info"
#: Points a finding costs its axis.
COST = {ERROR: 2, WARNING: 1, INFO: 0}
#: The top score of an axis.
TOP = 5

#: The axes, in the rubric's order: (name, title).
AXES = (
    ("message_design", "message design"),
    ("idempotency", "idempotency enforced"),
    ("retry_policy", "retry policy with classification"),
    ("dead_letters", "dead-letter ownership"),
    ("ordering_concurrency", "ordering and concurrency"),
    ("scheduled_work", "scheduled work"),
    ("observability", "observability"),
)
TITLES = dict(AXES)
#: The axis of each code's first digit.
AXIS_OF_DIGIT = {str(number): name for number, (name, _) in enumerate(AXES, start=1)}

#: Task-name prefixes that are not graded: Celery's own tasks and the extension's.
SKIPPED_PREFIXES = ("celery.", "django_celery_guardrails.")
#: Seconds above which a task counts as long for the prefetch finding (GA502).
LONG_TASK = 60.0
#: Kombu's Redis transport default visibility_timeout, seconds.
DEFAULT_VISIBILITY = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One thing to change: ``subject`` is the task or setting (or beat entry) it names."""

    code: str
    axis: str
    severity: str
    subject: str
    message: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Axis:
    """One axis of the rubric: its score (0 to 5) and the findings that cost it points."""

    name: str
    score: int
    findings: tuple[Finding, ...] = ()

    @property
    def title(self) -> str:
        return TITLES[self.name]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "score": self.score,
            "findings": [finding.as_dict() for finding in self.findings],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Every axis, in the rubric's order, and every finding."""

    axes: tuple[Axis, ...]
    findings: tuple[Finding, ...] = field(default=())

    @property
    def lowest(self) -> int:
        return min(axis.score for axis in self.axes)

    def below(self, threshold: int) -> list[Axis]:
        """The axes that score below ``threshold``."""
        return [axis for axis in self.axes if axis.score < threshold]

    def as_dict(self) -> dict[str, Any]:
        return {
            "lowest": self.lowest,
            "axes": [axis.as_dict() for axis in self.axes],
            "findings": [finding.as_dict() for finding in self.findings],
        }


def _finding(code: str, severity: str, subject: str, message: str, fix: str) -> Finding:
    return Finding(code=code, axis=AXIS_OF_DIGIT[code[2]], severity=severity, subject=subject, message=message, fix=fix)


def report_of(findings: Iterable[Finding]) -> Report:
    """Score the axes of ``findings`` (see the module docstring for the rule)."""
    found = tuple(sorted(findings, key=lambda f: (f.code, f.subject)))
    axes = []
    for name, _ in AXES:
        mine = tuple(f for f in found if f.axis == name)
        axes.append(Axis(name=name, score=max(0, TOP - sum(COST[f.severity] for f in mine)), findings=mine))
    return Report(axes=tuple(axes), findings=found)


def audit(app: Any) -> Report:
    """Grade ``app``: its config, guardrails options and registered tasks (no broker, store or database read).

    Raises :class:`~celery_guardrails.exceptions.ConfigurationError` when the guardrails settings themselves
    are invalid (the worker would not start: that is the first thing to fix).
    """
    from celery_guardrails.options import app_settings

    app_settings(app)  # an invalid config is reported as such, before anything is graded against it
    # The app's task modules (include, imports, autodiscovery), as a worker imports them; when that fails, what
    # is registered is graded (the CLI says the import failed).
    with contextlib.suppress(Exception):
        app.loader.import_default_modules()
    tasks = [task for name, task in sorted(app.tasks.items()) if not name.startswith(SKIPPED_PREFIXES)]
    from celery_guardrails.task import GuardedTask

    guarded = [task for task in tasks if isinstance(task, GuardedTask)]
    findings: list[Finding] = []
    findings += _message_design(app, tasks, guarded)
    findings += _idempotency(guarded)
    findings += _retry_policy(app, tasks, guarded)
    findings += _dead_letters(app, guarded)
    findings += _ordering_concurrency(app, tasks, guarded)
    findings += _scheduled_work(app)
    findings += _observability(app)
    return report_of(findings)


def _message_design(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    found = []
    for task in tasks:
        if task not in guarded:
            found.append(
                _finding(
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
            _finding(
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
            _finding(
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
                _finding(
                    "GA102",
                    WARNING,
                    task.name,
                    "max_payload_bytes=0 on the task: any payload size is published and retained",
                    "remove max_payload_bytes from the task, or set a limit in bytes",
                )
            )
        if task_attribute(task, "sensitive_keys") is not None and not resolve(task, "sensitive_keys", {}):
            found.append(
                _finding(
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
                _finding(
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
                _finding(
                    "GA105",
                    ERROR,
                    task.name,
                    f"payload_version {version} is not in accepts_versions {list(accepted)}: its workers "
                    "dead-letter every message its publishers send (unknown_payload_version)",
                    f"add {version} to accepts_versions",
                )
            )
    return found


def _retried_unknown(task: Any) -> bool:
    return bool(resolve(task, "idempotent", {}) or resolve(task, "retry_unsafe", {}))


def _idempotency(guarded: list[Any]) -> list[Finding]:
    return [
        _finding(
            "GA201",
            WARNING,
            task.name,
            "retried on unknown and ambiguous errors (idempotent or retry_unsafe) with no idempotency_key: two "
            "deliveries of one message can both act",
            'set idempotency_key="<name>:{<argument>}" so that each delivery claims the key where the effect lands',
        )
        for task in guarded
        if _retried_unknown(task) and resolve(task, "idempotency_key", {}) is None
    ]


def _time_limit(app: Any, task: Any) -> float | None:
    limit = task.time_limit or app.conf.task_time_limit
    return float(limit) if limit else None


def _retry_policy(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    found = []
    for task in guarded:
        if resolve(task, "retry_unsafe", {}):
            found.append(
                _finding(
                    "GA301",
                    WARNING,
                    task.name,
                    "retry_unsafe: retried on ambiguous failures (a read timeout, a 5xx) although not idempotent; "
                    "the dependency may act twice on one message",
                    "give it an idempotency_key (or idempotent=True where it is) and drop retry_unsafe",
                )
            )
        if not task.acks_late:
            found.append(
                _finding(
                    "GA302",
                    WARNING,
                    task.name,
                    "acks_late is off: the message is acked before the task ran, and lost if its worker dies",
                    "remove acks_late=False (GuardedTask acks late)",
                )
            )
        if _time_limit(app, task) and not (task.soft_time_limit or app.conf.task_soft_time_limit):
            found.append(
                _finding(
                    "GA304",
                    WARNING,
                    task.name,
                    "a hard time_limit without soft_time_limit: the pool kills the process without a word to the task",
                    "set soft_time_limit below time_limit so the task can stop cleanly",
                )
            )
    for task in tasks:
        if task.acks_late and not task.reject_on_worker_lost:
            found.append(
                _finding(
                    "GA303",
                    WARNING,
                    task.name,
                    "acks_late without reject_on_worker_lost: a message whose worker process dies is acked away "
                    "instead of delivered again",
                    "set reject_on_worker_lost=True (GuardedTask does; poison protection bounds the loop)",
                )
            )
    return found


def _mail_recipients_missing(app: Any, guarded: list[Any]) -> str | None:
    """Why mail alerts reach nobody, or None when they reach someone."""
    from celery_guardrails.alerts import _django_configured
    from celery_guardrails.outcomes import owner_of

    if not _django_configured():
        return "there are no Django settings to send mail with"
    from django.conf import settings

    if list(getattr(settings, "ADMINS", None) or ()):
        return None
    addresses = app_value(app, "owner_emails")
    owners = {owner_of(task) or "" for task in guarded}
    owners |= {policy.owner for policy in app_value(app, "schedules").values() if policy.owner}
    missing = sorted(owner or "(no owner)" for owner in owners if not addresses.get(owner))
    if not missing:
        return None
    return f"no ADMINS, and no owner_emails for {', '.join(missing)}"


def _dead_letters(app: Any, guarded: list[Any]) -> list[Finding]:
    from celery_guardrails.outcomes import owner_of

    found = [
        _finding(
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
    channels = tuple(app_value(app, "alert_channels"))
    if not set(channels) - {"log"}:
        found.append(
            _finding(
                "GA402",
                WARNING,
                "alert_channels",
                f"alert_channels is {list(channels)}: a dead letter is at most a log line nobody is paged for",
                'add "mail" (owner_emails or ADMINS) or "webhook" (alert_webhooks)',
            )
        )
    if "webhook" in channels and not app_value(app, "alert_webhooks"):
        found.append(
            _finding(
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
                _finding(
                    "GA404",
                    WARNING,
                    "owner_emails",
                    f'"mail" is an alert channel but {why}: no alert is mailed',
                    "set owner_emails per owner, or ADMINS",
                )
            )
    if not app_value(app, "seal_keys"):
        found.append(
            _finding(
                "GA405",
                WARNING,
                "seal_keys",
                "no seal_keys: a dead letter whose arguments had a secret redacted cannot be replayed",
                "set seal_keys to Fernet keys read from the environment",
            )
        )
    return found


def _is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "redis+socket://", "unix://"))


def _ordering_concurrency(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    found = []
    broker = str(app.conf.broker_url or "")
    if _is_redis(broker):
        visibility = float((app.conf.broker_transport_options or {}).get("visibility_timeout", DEFAULT_VISIBILITY))
        lease = app_value(app, "broker_lease")
        for task in tasks:
            longer = []
            if task in guarded:
                longer.append(("backoff_max", float(resolve(task, "backoff_max", {}))))
                later = float(resolve(task, "retry_later_delay", {})) * resolve(task, "retry_later_max", {})
                longer.append(("retry_later_delay * retry_later_max", later))
            limit = _time_limit(app, task)
            if limit and task.acks_late and not lease:
                longer.append(("time_limit", limit))
            over = [f"{name} {value:g} s" for name, value in longer if value >= visibility]
            if over:
                found.append(
                    _finding(
                        "GA501",
                        WARNING,
                        task.name,
                        f"{', '.join(over)}: not shorter than the Redis visibility_timeout {visibility:g} s: the "
                        "message is delivered twice",
                        "lower them below broker_transport_options['visibility_timeout'] (or raise it; keep "
                        "broker_lease on)",
                    )
                )
    prefetch = app.conf.worker_prefetch_multiplier
    if prefetch is not None and prefetch > 1:
        long_tasks = [task.name for task in tasks if (_time_limit(app, task) or float("inf")) > LONG_TASK]
        if long_tasks:
            shown = ", ".join(long_tasks[:10]) + (f" and {len(long_tasks) - 10} more" if len(long_tasks) > 10 else "")
            found.append(
                _finding(
                    "GA502",
                    WARNING,
                    "worker_prefetch_multiplier",
                    f"worker_prefetch_multiplier is {prefetch} with tasks whose time_limit is unset or over "
                    f"{LONG_TASK:g} s ({shown}): messages wait behind a long task in a worker that holds them",
                    "set worker_prefetch_multiplier = 1 (or time_limit of 60 s or less on those tasks)",
                )
            )
    for task in guarded:
        if resolve(task, "ordering_key", {}) is not None and resolve(task, "idempotency_key", {}) is None:
            found.append(
                _finding(
                    "GA503",
                    WARNING,
                    task.name,
                    "ordering_key without idempotency_key: a duplicate delivery of a message (a redelivery) runs again",
                    "set idempotency_key as well",
                )
            )
    return found


def _schedule_of(entry: Any) -> Any:
    return entry.get("schedule") if isinstance(entry, dict) else getattr(entry, "schedule", None)


def _task_of(entry: Any) -> str:
    return str(entry.get("task") if isinstance(entry, dict) else getattr(entry, "task", ""))


def _scheduled_work(app: Any) -> list[Finding]:
    from celery_guardrails.outcomes import owner_of
    from celery_guardrails.stores import django_apps_installed

    found = []
    entries = dict(app.conf.beat_schedule or {})
    policies = app_value(app, "schedules")
    for name, entry in sorted(entries.items()):
        policy = policies.get(name)
        if policy is None:
            found.append(
                _finding(
                    "GA601",
                    WARNING,
                    name,
                    "a beat entry with no policy: no stated timezone, overlap or catch-up, no run ledger, no "
                    "missed-run detection",
                    f'add schedules["{name}"] = {{"timezone": ..., "overlap": "skip", "catch_up": "latest"}}',
                )
            )
            continue
        schedule = _schedule_of(entry)
        own_zone = getattr(schedule, "__dict__", {}).get("tz")
        if policy.timezone is None and own_zone is None and isinstance(schedule, crontab | str):
            found.append(
                _finding(
                    "GA602",
                    WARNING,
                    name,
                    f"a crontab whose policy states no timezone: read in the app's zone ({app.conf.timezone or 'UTC'})",
                    f'set schedules["{name}"]["timezone"] (an IANA name such as "Europe/Berlin")',
                )
            )
        task = app.tasks.get(_task_of(entry))
        if task is not None and not hasattr(task, "guardrails"):
            found.append(
                _finding(
                    "GA605",
                    ERROR,
                    name,
                    f"a policy for an entry whose task {task.name} is not a GuardedTask: the worker and beat refuse "
                    "to start",
                    f"make {task.name} a GuardedTask, or remove the policy",
                )
            )
        elif not policy.owner and (task is None or owner_of(task) is None):
            found.append(
                _finding(
                    "GA603",
                    WARNING,
                    name,
                    "nobody hears of its missed and overdue runs: no owner in its policy or on its task",
                    f'set schedules["{name}"]["owner"], or an owner on its task',
                )
            )
    if not django_apps_installed("django_celery_beat"):
        for name in sorted(set(policies) - set(entries)):
            found.append(
                _finding(
                    "GA604",
                    ERROR,
                    name,
                    "a schedules policy for a beat entry that does not exist: the worker and beat refuse to start",
                    f'add "{name}" to beat_schedule, or remove its policy',
                )
            )
    if policies and not app_value(app, "watchdog"):
        found.append(
            _finding(
                "GA606",
                INFO,
                "watchdog",
                "the workers' missed-run watchdog is off",
                "run manage.py guardrails_watchdog from cron (or a Kubernetes CronJob), or turn watchdog on",
            )
        )
    return found


def _observability(app: Any) -> list[Finding]:
    found = []
    if not app_value(app, "metrics"):
        found.append(
            _finding(
                "GA701",
                WARNING,
                "metrics",
                "metrics is off: no Prometheus metrics (durations, outcomes, queue wait, arrivals against throughput)",
                "set metrics=True (the prometheus extra) and scrape metrics_port or the Django view",
            )
        )
    else:
        from celery_guardrails import metrics

        if not metrics.available():
            found.append(
                _finding(
                    "GA703",
                    WARNING,
                    "metrics",
                    "metrics is on but prometheus-client is not installed: nothing is recorded",
                    "pip install 'celery-guardrails[prometheus]'",
                )
            )
    if not app_value(app, "activity"):
        found.append(
            _finding(
                "GA702",
                WARNING,
                "activity",
                "activity is off: no last day of outcomes and queue samples for the dashboard and the status rates",
                "remove activity=False",
            )
        )
    return found


def render(report: Report, *, min_score: int) -> str:
    """The report as text: per axis its score and findings, each with its fix; then the verdict."""
    lines = []
    for axis in report.axes:
        lines.append(f"{axis.title}: {axis.score}/{TOP}")
        for finding in axis.findings:
            lines.append(f"  {finding.code} {finding.severity:<7} {finding.subject}: {finding.message}")
            lines.append(f"        fix: {finding.fix}")
    below = report.below(min_score)
    if below:
        names = ", ".join(f"{axis.title} {axis.score}" for axis in below)
        lines.append(f"FAIL: below {min_score}: {names}")
    else:
        lines.append(f"OK: every axis scores {min_score} or more (lowest {report.lowest})")
    return "\n".join(lines)


def as_json(report: Report, *, min_score: int) -> str:
    """The report as JSON, with the threshold and whether it passed."""
    data = report.as_dict()
    data["min_score"] = min_score
    data["passed"] = not report.below(min_score)
    return json.dumps(data, indent=2)


__all__ = ["AXES", "Axis", "Finding", "Report", "as_json", "audit", "render", "report_of"]
