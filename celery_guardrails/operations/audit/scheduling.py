"""The scheduled-work axis (GA6xx): every beat entry (``beat_schedule``, and django-celery-beat's rows when its
table can be read) graded against its ``schedules`` policy: not watched, watched with the default policy, opted
out, no timezone, nobody told of a missed run; a policy for an entry that does not exist or whose task is not a
``GuardedTask`` (beat and the worker refuse to start); the missed-run watchdog off.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations.audit.model import ERROR, INFO, WARNING, Finding, finding
from celery_guardrails.options import app_value
from celery_guardrails.scheduling.policy import DEFAULT_POLICY


def _schedule_of(entry: Any) -> Any:
    return entry.get("schedule") if isinstance(entry, dict) else getattr(entry, "schedule", None)


def _task_of(entry: Any) -> str:
    return str(entry.get("task") if isinstance(entry, dict) else getattr(entry, "task", ""))


def _django_beat_installed() -> bool:
    from celery_guardrails.stores import django_apps_installed

    return django_apps_installed("django_celery_beat")


def _beat_rows(app: Any) -> dict[str, Any] | None:
    """django-celery-beat's rows as beat entries (enabled or not), by name; None when django-celery-beat is not
    installed or its table cannot be read (not migrated yet)."""
    from celery_guardrails.scheduling.entries import registered_rows

    periodic_task_rows = registered_rows()
    if periodic_task_rows is None:
        return None
    try:
        enabled, disabled, _ = periodic_task_rows(app, names=None)
    except Exception:  # no table yet, no database: the rows are not graded (an audit never raises)
        return None
    return {**disabled, **enabled}


def schedule_rules(app: Any) -> list[Finding]:
    """Scheduled work (GA6xx): every beat entry and django-celery-beat row against its schedule policy, the
    policies that name no entry, and the watchdog."""
    from celery_guardrails.exceptions import ConfigurationError
    from celery_guardrails.runtime.outcomes import owner_of
    from celery_guardrails.scheduling.beat import Entry, read_entry, states_no_timezone

    found = []
    entries = dict(app.conf.beat_schedule or {})
    rows = _beat_rows(app)
    # A settings entry django-celery-beat copied into its table is graded once, as the settings entry.
    every = {**(rows or {}), **entries}
    policies = app_value(app, "schedules")
    for name, entry in sorted(every.items()):
        policy = policies.get(name, DEFAULT_POLICY)
        kind = "beat entry" if name in entries else "periodic task"
        try:
            read = read_entry(app, name, entry, policy=policy)
        except ConfigurationError:
            read = None  # a policy whose schedule cannot be read: the worker and beat say it as they start
        if policy is None:
            found.append(
                finding(
                    "GA608",
                    INFO,
                    name,
                    f"a {kind} opted out of the schedule guardrails (its policy is None): no run ledger, no missed-run "
                    "detection",
                    f'remove schedules["{name}"] to watch it with the default policy',
                )
            )
            continue
        schedule = _schedule_of(entry)
        task = app.tasks.get(_task_of(entry))
        if policy.default:
            if not isinstance(read, Entry):
                if read is not None and not read.expected:  # Celery's own, the app's own, one-off rows: by design
                    found.append(
                        finding(
                            "GA601",
                            WARNING,
                            name,
                            f"a {kind} that is not watched: {read.reason}: no run ledger, no missed-run detection",
                            "make its task a GuardedTask (or give it a schedule the guardrails read), or opt it out "
                            f'with schedules["{name}"] = None',
                        )
                    )
                continue
            found.append(
                finding(
                    "GA607",
                    INFO,
                    name,
                    f"a {kind} watched with the default policy (overlap skip, catch-up latest, grace {read.grace:g} s)",
                    f'write schedules["{name}"] = {{"timezone": ..., "grace": ..., "owner": ...}} to state its own, '
                    "or None to opt out",
                )
            )
        if states_no_timezone(schedule, policy):
            found.append(
                finding(
                    "GA602",
                    WARNING,
                    name,
                    f"a crontab whose policy states no timezone: read in the app's zone ({app.conf.timezone or 'UTC'})",
                    f'set schedules["{name}"]["timezone"] (an IANA name such as "Europe/Berlin")',
                )
            )
        if not policy.default and task is not None and not hasattr(task, "guardrails"):
            found.append(
                finding(
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
                finding(
                    "GA603",
                    WARNING,
                    name,
                    "nobody hears of its missed and overdue runs: no owner in its policy or on its task",
                    f'set schedules["{name}"]["owner"], or an owner on its task',
                )
            )
    if rows is not None or not _django_beat_installed():
        for name in sorted(n for n, policy in policies.items() if policy is not None and n not in every):
            found.append(
                finding(
                    "GA604",
                    ERROR,
                    name,
                    "a schedules policy for a beat entry that does not exist: the worker and beat refuse to start",
                    f'add "{name}" to beat_schedule (or a PeriodicTask of that name), or remove its policy',
                )
            )
    if (policies or every) and not app_value(app, "watchdog"):
        found.append(
            finding(
                "GA606",
                INFO,
                "watchdog",
                "the workers' missed-run watchdog is off",
                "run manage.py guardrails_watchdog from cron (or a Kubernetes CronJob), or turn watchdog on",
            )
        )
    return found
