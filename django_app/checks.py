"""System checks: ``manage.py check`` grades the guardrails configuration.

guardrails.E001  ``CELERY_GUARDRAILS`` has an unknown key or a bad value (the message names it, never a
                 secret it holds: keys, tokens and URL credentials are not shown).
guardrails.E002  a guarded task's option is refused, as the worker would refuse it at start-up (the message
                 names task and option): a bad value, or a key template whose field names a secret
                 (``idempotency_key="pay:{api_token}"``).
guardrails.W001  the context middleware is not installed: requests will not stamp their correlation id and
                 tenant on the tasks they enqueue.
guardrails.W002  no ``seal_keys``: dead letters keep no sealed copy, so a record whose arguments had a secret
                 redacted cannot be replayed.
guardrails.W003  a setting that is allowed but weakens a guardrail: ``redact_keys`` empty (in
                 ``CELERY_GUARDRAILS`` or on a task), so nothing is redacted by name.
guardrails.W006  the guardrails store is the Django database on a server, and Celery's Django fixup closes its
                 connections before and after every task (``CELERY_DB_REUSE_MAX`` unset; no Django pool, or
                 the prefork pool, whose fixup closes the pool with every task): each guarded task opens a new
                 connection. The audit's rule GA006 (:func:`celery_guardrails.operations.audit.connection_rules`),
                 for the app's ``worker_pool``; a worker says it at start for the pool it runs.
guardrails.E010  ``admin_tenants`` names a callable that cannot be imported or is not callable (a bad value
                 is E001): until it is fixed, admin users who are scoped by it see nothing.
guardrails.I001  beat entries (``CELERY_BEAT_SCHEDULE``) and django-celery-beat periodic tasks with no policy
                 written: they are watched with the default policy (missed runs detected, the ledger, catch-up
                 and overlap rules); one message names them all, with each one's grace (silence it with
                 ``SILENCED_SYSTEM_CHECKS``).
guardrails.W004  the ``schedules`` setting names an entry that does not exist, or one whose schedule cannot be
                 read: beat and the worker refuse to start (a warning, not an error: the row may come with a
                 migration or a fixture still to be loaded).
guardrails.W005  beat entries or periodic tasks with no policy that are not watched (one message names them):
                 the task is a plain Celery task, or the schedule cannot be read (solar, clocked). Celery's
                 ``celery.backend_cleanup``, the app's own ``django_celery_guardrails.prune`` and one-off rows
                 are left out on purpose.

The deployment audit (:mod:`celery_guardrails.operations.audit`) of the project's Celery app, as deployment checks
(``manage.py check --deploy``; the audit reads every registered task, so it is not run before every command):
one ``Warning`` per finding, its ``obj`` the task, setting or beat entry the finding names, with the finding's
fix as the hint. Each finding code has its id, ``guardrails.W1`` + the code's axis digit + its number (GA0xx,
placement, is W10x; GA8xx, tests, W18x):

    GA001 W101  task_always_eager on        GA401 W141  guarded task without owner
    GA002 W102  publish inside a            GA402 W142  alert_channels empty or only "log"
                transaction, not on commit  GA403 W143  "webhook" without alert_webhooks
    GA003 W103  waits on a result (request) GA404 W144  "mail" with nobody to mail
    GA004 W104  waits on a result (script)  GA405 -     no seal_keys: W002 says it (not twice)
    GA005 W105  RabbitMQ without publisher
                confirms
    GA006 -     connections closed around
                every task: W006 says it
    GA009 W109  source not read whole       GA501 W151  Redis visibility_timeout not longer than a limit
    GA101 W111  plain Celery task           GA502 W152  prefetch above 1 with long tasks
    GA102 W112  no max_payload_bytes        GA503 W153  ordering_key without idempotency_key
    GA103 W113  allow_sensitive_payload     GA601 W161  beat entry not watched
    GA104 W114  no sensitive_keys           GA602 W162  crontab policy without timezone
    GA105 W115  accepts_versions without    GA603 W163  schedule without owner
                its payload_version         GA604 W164  policy for a missing entry
    GA106 -     redact_keys empty: W003
    GA201 W121  retried without a key       GA605 W165  policy for a plain task's entry
    GA202 W122  key never reaches effect    GA606 W166  watchdog off
    GA301 W131  retry_unsafe (zero rule)    GA701 W171  metrics off
    GA302 W132  acks_late off               GA702 W172  activity off
    GA303 W133  acks_late without           GA703 W173  metrics without prometheus-client
                reject_on_worker_lost       GA801 W181  no test uses the test kit
    GA304 W134  time_limit without          GA802 W182  guarded task no kit test names
                soft_time_limit             GA809 W189  tests not read whole
    GA305 W135  plain task retried          GA607 -     default policy: I001 says it
                (zero rule)                 GA608 -     opted out (a choice)
    GA306 W136  fixed retry interval
    GA307 W137  retried on any error
    GA308 W138  more than 10 retries
    GA309 W139  never retried automatically
    GA504 W154  RabbitMQ: time_limit unset or over the consumer_timeout
    GA203 W123  atomic=True without idempotency_key: no transaction at all

The audit check never raises: an app that cannot be loaded or audited gives no audit warnings (an invalid
``CELERY_GUARDRAILS`` is E001).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.db import DatabaseError

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import OPTIONS, django_settings, validate_task, warnings_about

#: The system check id of each audit finding code (see the module docstring); None: another check says it.
AUDIT_IDS: dict[str, str | None] = {
    **{f"GA{axis}0{number}": f"guardrails.W1{axis}{number}" for axis in range(9) for number in range(1, 10)},
    "GA405": None,
    # The Django store's connections closed around every task: W006 in plain `check` (the same rule).
    "GA006": None,
    # An empty redact_keys is W003 in plain `check` (the same rule: celery_guardrails.options.weak_settings).
    "GA106": None,
    # Plain `check` names the entries watched with the default policy (I001); an opted-out entry is a choice.
    "GA607": None,
    "GA608": None,
}

MIDDLEWARE_PATH = "django_celery_guardrails.middleware.GuardrailsContextMiddleware"


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    try:
        django_settings()
    except ConfigurationError as exc:
        return [Error(str(exc), hint="See the documentation's settings page (docs/settings.md).", id="guardrails.E001")]
    return []


@register(Tags.compatibility)
def check_tasks(app_configs: Any = None, **kwargs: Any) -> list[Error | Warning]:
    """The project's guarded tasks, checked as a worker checks them at start-up (their modules imported as a
    worker imports them), and the settings that weaken a guardrail."""
    try:
        settings_checked = django_settings()
    except ConfigurationError:
        return []  # E001 says it
    tasks = _guarded_tasks()
    messages: list[Error | Warning] = []
    for task in tasks:
        try:
            validate_task(task)
        except ConfigurationError as exc:
            messages.append(
                Error(str(exc), hint="See the task options in the README.", obj=task.name, id="guardrails.E002")
            )
    for warning in warnings_about(settings_checked, tasks):
        messages.append(Warning(warning, hint="Leave redact_keys unset for the defaults.", id="guardrails.W003"))
    return messages


def _guarded_tasks() -> list[Any]:
    """The guarded tasks of the project's Celery app; none when it cannot be loaded (a check never raises)."""
    from celery_guardrails.runtime.pipeline import is_guarded

    from .health import celery_app

    try:
        app = celery_app()
        if not getattr(_importing, "on", False):
            # Celery's Django fixup runs the system checks when the task modules are imported: this check, run
            # from inside that import, reads what is registered so far instead of importing again (for ever).
            _importing.on = True
            try:
                with contextlib.suppress(Exception):  # a task module that fails to import is the worker's to say
                    app.loader.import_default_modules()
            finally:
                _importing.on = False
        return [task for _, task in sorted(app.tasks.items()) if is_guarded(task)]
    except Exception:
        return []


_importing = threading.local()


@register(Tags.compatibility)
def check_schedules(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Name every beat entry watched with the default policy (I001) and every one not watched that could be
    (W005); a schedules setting beat would refuse is W004."""
    from celery_guardrails.scheduling.beat import Entry, watch_list

    from .health import celery_app

    try:
        django_settings()
    except ConfigurationError:
        return []  # E001 says it
    try:
        app = celery_app()
        _guarded_tasks()  # the task modules imported as beat imports them: a plain task is known as such
        try:
            watches = watch_list(app)
        except DatabaseError:  # django-celery-beat's table not migrated yet: the settings entries only
            watches = watch_list(app, rows=False)
    except ConfigurationError as exc:
        return [Warning(str(exc), hint="See Scheduled work in the README.", obj="schedules", id="guardrails.W004")]
    except Exception:  # a check never raises: an app that cannot be loaded says so elsewhere
        return []
    defaults, unwatched = [], []
    for watch in watches:
        found, state = watch.found, "disabled, " if watch.disabled else ""
        if isinstance(found, Entry) and found.default:
            defaults.append(f"{watch.kind} {watch.name!r} ({state}grace {found.grace:g} s)")
        elif not isinstance(found, Entry) and not found.expected:
            unwatched.append(f"{watch.kind} {watch.name!r} ({found.reason})")
    # One message each, however many entries: Django prints the checks before every management command.
    messages: list[CheckMessage] = []
    if defaults:
        messages.append(
            Info(
                f"{_count(defaults, 'beat entry', 'beat entries')} watched with the default policy (missed when "
                f"later than its grace, overlap skip, catch-up latest): {_names(defaults)}.",
                hint='State a policy with CELERY_GUARDRAILS["schedules"]["<name>"] = {...}, or opt one out with None; '
                'silence this with SILENCED_SYSTEM_CHECKS = ["guardrails.I001"].',
                obj="schedules",
                id="guardrails.I001",
            )
        )
    if unwatched:
        messages.append(
            Warning(
                f"{_count(unwatched, 'beat entry', 'beat entries')} not watched, no missed-run detection: "
                f"{_names(unwatched)}.",
                hint="Make the task a GuardedTask (base=GuardedTask), or opt the entry out with "
                'CELERY_GUARDRAILS["schedules"]["<name>"] = None.',
                obj="schedules",
                id="guardrails.W005",
            )
        )
    return messages


#: Entries a schedules check message names at most (then "and N more").
NAMED = 20


def _count(items: list[str], one: str, many: str) -> str:
    return f"1 {one} is" if len(items) == 1 else f"{len(items)} {many} are"


def _names(items: list[str]) -> str:
    more = len(items) - NAMED
    return "; ".join(items[:NAMED]) + (f"; and {more} more" if more > 0 else "")


@register(Tags.compatibility)
def check_middleware(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    if MIDDLEWARE_PATH in getattr(settings, "MIDDLEWARE", ()):
        return []
    return [
        Warning(
            "GuardrailsContextMiddleware is not in MIDDLEWARE.",
            hint=f"Add {MIDDLEWARE_PATH!r} so tasks enqueued by a request carry its tenant and request id.",
            id="guardrails.W001",
        )
    ]


@register(Tags.security)
def check_seal_keys(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    try:
        keys = django_settings().get("seal_keys")
    except ConfigurationError:
        return []  # E001 says it
    if keys:
        return []
    return [
        Warning(
            "CELERY_GUARDRAILS has no seal_keys: a dead letter whose arguments had a secret redacted cannot be "
            "replayed.",
            # The command itself, where the warning is read: the Quick start's reader has not reached Dead letters.
            hint="Make a key with: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())', set it as GUARDRAILS_SEAL_KEY in the environment of the web "
            "and worker processes, and read it in CELERY_GUARDRAILS['seal_keys'] (README: Quick start).",
            id="guardrails.W002",
        )
    ]


@register(Tags.compatibility)
def check_connections(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    try:
        from celery_guardrails.operations.audit import connection_rules

        from .health import celery_app

        found = connection_rules(celery_app())
    except Exception:  # a check never raises: an app that cannot be loaded is no finding
        return []
    return [
        Warning(f"{finding.message} ({finding.code})", hint=finding.fix, obj=finding.subject, id="guardrails.W006")
        for finding in found
    ]


@register(Tags.security)
def check_admin_tenants(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    from .scoping import OPTION, raw_option, rule

    try:
        raw = raw_option()
        OPTIONS[OPTION].check(raw)
    except (TypeError, ValueError):
        return []  # E001 says it
    try:
        rule()
    except ConfigurationError as exc:
        return [
            Error(
                str(exc),
                hint="Give CELERY_GUARDRAILS['admin_tenants'] a callable from a user to the tenant ids they may see "
                "(or a dotted path to one), or 'permissions' (README, Dead letters: Tenant scoping in the admin).",
                id="guardrails.E010",
            )
        ]
    return []


@register(Tags.compatibility, deploy=True)
def check_audit(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    try:
        from celery_guardrails.operations.audit import audit

        from .health import celery_app

        report = audit(celery_app())
    except Exception:  # a check never raises: an app that cannot be loaded is no audit finding
        return []
    return [
        Warning(f"{finding.message} ({finding.code})", hint=finding.fix, obj=finding.subject, id=check_id)
        for finding in report.findings
        if (check_id := AUDIT_IDS.get(finding.code)) is not None
    ]
