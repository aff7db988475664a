"""The deployment audit: grade a Celery app's configuration, tasks and source against the background-jobs rubric.

:func:`audit` reads what can be checked without running anything: the app's config (``app.conf``), the
guardrails options (through :func:`~celery_guardrails.options.app_value` and
:func:`~celery_guardrails.options.resolve`, the one lookup rule), the registered tasks, after the app's task
modules are imported as a worker imports them, and the project's own Python source, parsed and never imported
(:mod:`celery_guardrails.operations.audit_source`). It talks to no broker, store or database. Celery's own tasks
(``celery.*``) and the extension's (``django_celery_guardrails.*``: the prune task) are not graded: a finding
names something the project can change.

Where the source is read: ``audit(app, source=...)`` (``--source DIR`` on both commands); else Django's
``settings.BASE_DIR`` when Django is configured; else the current directory. The tests are looked for below the
same folder, except that when it is ``BASE_DIR`` and holds no test file, they are looked for below its parent
(a repository whose ``tests/`` sits beside the Django project, as this one's does).

Nine axes, in the rubric's order, each scored from 5 down: a finding costs its axis 2 points when its severity
is ``error`` (the worker refuses to start, messages are lost or refused by design, an effect can happen twice),
1 when ``warning``, 0 when ``info`` (listed for a reviewer: a deliberate, documented opt-out, or a consequence
worth knowing); a score never goes below 0. **The zero rule**: a handler retried while not idempotent (GA301,
GA305) scores the retry axis 0, whatever else is right. A deployment passes the rubric's threshold when no axis
scores below 3 and the average is at least 4 (:data:`MIN_SCORE`, :data:`MIN_AVERAGE`; the commands'
``--min-score`` and ``--min-average``). Every finding has a stable code, its first digit its axis:

placement (what runs in the background, and how a request hands it over)
    GA001 error    ``task_always_eager`` is on: every task runs in the caller (the request), not on a worker
    GA002 warning  a module publishes (``.delay``/``.apply_async``) inside a database transaction without
                   on-commit: the worker can run the task before the commit, or for a transaction rolled back
    GA003 warning  a module waits on a task's result (``.get(``/``.wait(`` on what a publish or
                   ``AsyncResult`` returned): the request is held until a worker is done
    GA004 info     ... in a script or a management command (no request is held: listed)
    GA005 warning  RabbitMQ broker without publisher confirms (``broker_transport_options`` without
                   ``confirm_publish``, Celery's default): a publish the broker refuses (an exchange that does not
                   exist) returns as if sent, the message is lost, and the refusal fails the next publish on its
                   channel instead (the outbox relay confirms its own publishes whatever this says)
    GA009 info     the source was not read whole (the scan's bound, or no such folder): the rest is not graded
message design
    GA101 warning  a task that is a plain ``celery.Task``, not a ``GuardedTask`` (no context, no retry gate, no
                   dead letter, no payload contract)
    GA102 warning  ``max_payload_bytes`` is 0 (app or task): any payload size is published
    GA103 info     ``allow_sensitive_payload``: the task carries sensitive values, and says why (listed with the
                   reason)
    GA104 warning  ``sensitive_keys`` is empty (app or task): secrets are not refused at publish
    GA105 error    a task's ``accepts_versions`` leaves out its own ``payload_version``: its workers dead-letter
                   every message its publishers send
    GA106 warning  ``redact_keys`` is empty (app or task): nothing is redacted by its key name in dead letters
                   and logs
idempotency enforced
    GA201 warning  a task retried on unknown and ambiguous errors (``idempotent=True`` or ``retry_unsafe``) with
                   no ``idempotency_key``: nothing stops two deliveries from both acting
    GA202 warning  a keyed task whose key never reaches its effect: not ``atomic``, its code never reads
                   ``self.request.idempotency_key``, its body marks no effect: the key skips a duplicate of a
                   completed run only, and the task is never retried automatically
retry policy with classification
    GA301 error    ``retry_unsafe``: retried after failures that may have acted although not idempotent (zero rule)
    GA302 warning  a guarded task with ``acks_late`` off: acked before it ran
    GA303 warning  ``acks_late`` without ``reject_on_worker_lost`` (plain tasks too): a message whose worker
                   process dies is acked away instead of redelivered
    GA304 warning  a hard ``time_limit`` without ``soft_time_limit`` (guarded tasks): killed without a word
    GA305 error    a plain Celery task retried automatically (``autoretry_for``, ``max_retries`` or
                   ``retry_kwargs`` set, or ``.retry(`` in its code): run again whatever it did (zero rule)
    GA306 warning  a plain task retried at a fixed interval (``autoretry_for`` without ``retry_backoff``,
                   ``.retry()`` with no or a constant ``countdown``)
    GA307 warning  retried on any error: ``Exception``/``BaseException`` in ``autoretry_for`` or
                   ``transient_errors``, or ``.retry(`` under ``except Exception:``
    GA308 warning  more than 10 retries (``max_retries``, ``retry_kwargs``, ``.retry(max_retries=...)``, a
                   guarded task's ``max_attempts`` over 11), or ``max_retries=None`` (for ever)
    GA309 info     a guarded task that is never retried automatically: unkeyed, not idempotent, and its body
                   marks no effect, so the gate counts it as one effect from its first line (not a fault: the
                   fix says how to get retries)
dead-letter ownership
    GA401 warning  a guarded task with no owner (``owner=`` or an ``owners`` pattern)
    GA402 warning  ``alert_channels`` empty or only ``"log"``: nobody is told of a dead letter
    GA403 warning  ``"webhook"`` in ``alert_channels`` with no ``alert_webhooks``
    GA404 warning  ``"mail"`` in ``alert_channels`` with nobody to mail: no Django settings, or owners with no
                   ``owner_emails`` entry and no ``ADMINS``
    GA405 warning  no ``seal_keys``: a dead letter whose arguments had a secret redacted cannot be replayed
ordering and concurrency
    GA501 warning  Redis broker (``sentinel://`` too): a task's ``backoff_max``, ``retry_later_delay *
                   retry_later_max``, or (with ``broker_lease`` off) ``time_limit`` is not shorter than the
                   ``visibility_timeout`` (``broker_transport_options``, default 3600 s): the message is
                   delivered twice
    GA502 warning  ``worker_prefetch_multiplier`` above 1 with tasks whose ``time_limit`` is unset or over 60 s:
                   messages wait behind a long task in a worker that holds them
    GA503 warning  ``ordering_key`` without ``idempotency_key``: a redelivered message of a key runs twice
    GA504 warning  RabbitMQ broker: a guarded task whose ``time_limit`` is unset or longer than the consumer
                   timeout the app declares (``rabbitmq_consumer_timeout``, a queue's ``x-consumer-timeout``)
scheduled work
    GA601 warning  a beat entry (``beat_schedule``, or a django-celery-beat row) that is not watched: its task is
                   a plain Celery task, or its schedule cannot be read (solar, clocked): no run ledger, no
                   missed-run detection. Celery's ``celery.backend_cleanup``, the guardrails app's own tasks and
                   one-off rows are not graded.
    GA602 warning  a crontab entry whose policy states no ``timezone`` (nor its crontab): read in the app's zone
    GA607 info     a beat entry or django-celery-beat row watched with the default policy (no policy written)
    GA608 info     a beat entry opted out of the schedule guardrails (``schedules[name] = None``)
    GA603 warning  a scheduled entry nobody hears about: no policy ``owner`` and its task has none
    GA604 error    a policy for an entry that does not exist (the worker and beat refuse to start)
    GA605 error    a guarded entry whose task is registered and is not a ``GuardedTask`` (refused at start-up)
    GA606 info     ``watchdog`` off: missed runs are detected only if ``guardrails_watchdog`` runs from cron
observability
    GA701 warning  ``metrics`` off: no Prometheus metrics
    GA702 warning  ``activity`` off: no last-day activity for the dashboard's charts and the status rates
    GA703 warning  ``metrics`` on without prometheus-client installed: nothing can be recorded
tests (the project's tests prove its tasks on the rubric's bad days with the test kit)
    GA801 error    a project with guarded tasks none of whose test files uses the kit (``celery_guardrails.testing``)
    GA802 warning  a guarded task no test file that uses the kit names (the fix names the helper to start with)
    GA809 info     the tests were not read whole (the scan's bound): the rest is not graded

The defaults are not findings where they are safe: ``overlap`` ("skip") and ``catch_up`` ("latest") always have
a value in a policy, so a policy is graded on its timezone and owner; an entry with the default policy on its
owner (GA603), and named once (GA607). django-celery-beat's rows are read from the database when its table can
be read; when it cannot (not migrated), policies that name a row are assumed to exist. A file-level finding
(GA002-GA004) names the file, relative to the source folder, and its lines: one finding per file, so that a file
with many call sites costs its axis once.

A worker logs the audit's own findings as it starts (:func:`celery_guardrails.runtime.install.warn_about`): the
retry rules (GA201, GA202, GA3xx: :func:`retry_rules`), the visibility rule (GA501: :func:`visibility_rules`),
the redaction rule (GA106: :func:`redaction_rules`), the owner rule (GA401: :func:`owner_rules`) and, from its
consumer, the RabbitMQ consumer-timeout rule (GA504: :func:`consumer_timeout_rules`), so what a
worker warns about and what the audit grades is one rule, written once, with one threshold.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import inspect
import json
import os
import textwrap
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FunctionType
from typing import Any

from celery_guardrails.operations import audit_source
from celery_guardrails.options import (
    app_value,
    celery_option,
    celery_option_set,
    resolve,
    task_attribute,
)
from celery_guardrails.runtime.outbox import confirms_off
from celery_guardrails.scheduling.policy import DEFAULT_POLICY

ERROR = "error"
WARNING = "warning"
INFO = "info"
#: Points a finding costs its axis.
COST = {ERROR: 2, WARNING: 1, INFO: 0}
#: The top score of an axis.
TOP = 5
#: The rubric's threshold: no axis below MIN_SCORE, and an average of at least MIN_AVERAGE.
MIN_SCORE = 3
MIN_AVERAGE = 4.0

#: The axes, in the rubric's order: (name, title). A code's first digit is its axis' index here.
AXES = (
    ("placement", "placement"),
    ("message_design", "message design"),
    ("idempotency", "idempotency enforced"),
    ("retry_policy", "retry policy with classification"),
    ("dead_letters", "dead-letter ownership"),
    ("ordering_concurrency", "ordering and concurrency"),
    ("scheduled_work", "scheduled work"),
    ("observability", "observability"),
    ("tests", "tests"),
)
TITLES = dict(AXES)
#: The axis of each code's first digit.
AXIS_OF_DIGIT = {str(number): name for number, (name, _) in enumerate(AXES)}
#: The zero rule: a handler retried while not idempotent scores its axis 0, whatever else is right.
ZERO_RULE = frozenset({"GA301", "GA305"})

#: Task-name prefixes that are not graded: Celery's own tasks and the extension's.
SKIPPED_PREFIXES = ("celery.", "django_celery_guardrails.")
#: Seconds above which a task counts as long for the prefetch finding (GA502).
LONG_TASK = 60.0
#: Retries above which a policy counts as very high (GA308); a guarded task's max_attempts counts one run more.
MAX_RETRIES = 10
#: Celery's Task.default_retry_delay, seconds: the wait of a retry that names none.
CELERY_RETRY_DELAY = 180.0
#: Sites a file-level finding lists before "and N more".
SHOWN_SITES = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One thing to change: ``subject`` is the task, setting, beat entry or source file it names."""

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
    """Every axis, in the rubric's order, and every finding; where the source and the tests were read."""

    axes: tuple[Axis, ...]
    findings: tuple[Finding, ...] = field(default=())
    source: str | None = None
    tests_source: str | None = None

    @property
    def lowest(self) -> int:
        return min(axis.score for axis in self.axes)

    @property
    def average(self) -> float:
        return sum(axis.score for axis in self.axes) / len(self.axes)

    def below(self, threshold: int) -> list[Axis]:
        """The axes that score below ``threshold``."""
        return [axis for axis in self.axes if axis.score < threshold]

    def failures(self, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> list[str]:
        """Why the report misses the threshold (an axis below ``min_score``, the average below ``min_average``);
        empty when it passes."""
        failed = []
        below = self.below(min_score)
        if below:
            failed.append(f"below {min_score}: " + ", ".join(f"{axis.title} {axis.score}" for axis in below))
        if self.average < min_average:
            failed.append(f"average {self.average:.2f} below {min_average}")
        return failed

    def passed(self, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> bool:
        return not self.failures(min_score=min_score, min_average=min_average)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lowest": self.lowest,
            "average": round(self.average, 2),
            "source": self.source,
            "tests_source": self.tests_source,
            "axes": [axis.as_dict() for axis in self.axes],
            "findings": [finding.as_dict() for finding in self.findings],
        }


def _finding(code: str, severity: str, subject: str, message: str, fix: str) -> Finding:
    return Finding(code=code, axis=AXIS_OF_DIGIT[code[2]], severity=severity, subject=subject, message=message, fix=fix)


def report_of(findings: Iterable[Finding], *, source: str | None = None, tests_source: str | None = None) -> Report:
    """Score the axes of ``findings`` (see the module docstring for the rule, the zero rule included)."""
    found = tuple(sorted(findings, key=lambda f: (f.code, f.subject)))
    axes = []
    for name, _ in AXES:
        mine = tuple(f for f in found if f.axis == name)
        score = max(0, TOP - sum(COST[f.severity] for f in mine))
        if any(f.code in ZERO_RULE for f in mine):
            score = 0
        axes.append(Axis(name=name, score=score, findings=mine))
    return Report(axes=tuple(axes), findings=found, source=source, tests_source=tests_source)


def graded_tasks(app: Any) -> list[Any]:
    """The app's registered tasks the audit grades (not Celery's own, nor the extension's), by name."""
    return [task for name, task in sorted(app.tasks.items()) if not name.startswith(SKIPPED_PREFIXES)]


def audit(app: Any, *, source: str | os.PathLike[str] | None = None) -> Report:
    """Grade ``app``: its config, guardrails options, registered tasks and the project's source (no broker,
    store or database read). ``source``: the folder of the project's code (default: see the module docstring).

    Raises :class:`~celery_guardrails.exceptions.ConfigurationError` when the guardrails settings themselves
    are invalid (the worker would not start: that is the first thing to fix).
    """
    from celery_guardrails.options import app_settings

    app_settings(app)  # an invalid config is reported as such, before anything is graded against it
    # The app's task modules (include, imports, autodiscovery), as a worker imports them; when that fails, what
    # is registered is graded (the CLI says the import failed).
    with contextlib.suppress(Exception):
        app.loader.import_default_modules()
    tasks = graded_tasks(app)
    from celery_guardrails.runtime.task import GuardedTask

    guarded = [task for task in tasks if isinstance(task, GuardedTask)]
    code, tests = source_walks(source)
    findings: list[Finding] = []
    findings += _placement(app, code)
    findings += _message_design(app, tasks, guarded)
    findings += retry_rules(app, tasks)
    findings += _dead_letters(app, guarded)
    findings += _ordering_concurrency(app, tasks, guarded)
    findings += _scheduled_work(app)
    findings += _observability(app)
    findings += _tests(guarded, tests)
    return report_of(findings, source=str(code.root), tests_source=str(tests.root))


def _django_base_dir() -> Path | None:
    from celery_guardrails.operations.alerts import _django_configured

    if not _django_configured():
        return None
    from django.conf import settings

    base = getattr(settings, "BASE_DIR", None)
    return Path(base).resolve() if base else None


def source_walks(source: str | os.PathLike[str] | None = None) -> tuple[audit_source.Walk, audit_source.Walk]:
    """The walks of the project's code and of its tests (the module docstring says which folders)."""
    if source is not None:
        walked = audit_source.walk(Path(source).resolve())
        return walked, walked
    base = _django_base_dir()
    if base is None:
        walked = audit_source.walk(Path.cwd())
        return walked, walked
    walked = audit_source.walk(base)
    if walked.tests() or not walked.complete:
        return walked, walked
    # BASE_DIR holds no test of its own: the project's tests sit beside it (a repository's tests/ folder).
    return walked, audit_source.walk(base.parent)


def _sites(sites: Iterable[audit_source.Site]) -> dict[str, list[audit_source.Site]]:
    by_file: dict[str, list[audit_source.Site]] = {}
    for site in sites:
        by_file.setdefault(site.path, []).append(site)
    return by_file


def _lines(sites: list[audit_source.Site]) -> str:
    shown = ", ".join(
        f"{site.line}" + ("" if site.function == "<module>" else f" ({site.function})") for site in sites[:SHOWN_SITES]
    )
    more = f" and {len(sites) - SHOWN_SITES} more" if len(sites) > SHOWN_SITES else ""
    return ("line " if len(sites) == 1 else "lines ") + shown + more


def _placement(app: Any, walked: audit_source.Walk) -> list[Finding]:
    found = []
    if app.conf.task_always_eager:
        found.append(
            _finding(
                "GA001",
                ERROR,
                "task_always_eager",
                "task_always_eager is on: .delay() and .apply_async() run the task in the caller (the request), "
                "not on a worker: no queue, no ack, no redelivery",
                "turn task_always_eager off outside tests (CELERY_TASK_ALWAYS_EAGER); to test tasks on a real "
                "worker, use the test kit (celery_guardrails.testing)",
            )
        )
    if not walked.complete:
        found.append(
            _finding(
                "GA009",
                INFO,
                "source",
                f"the source under {walked.root} was not read whole ({walked.why_incomplete}): what was not read "
                "is not graded",
                "point --source (or BASE_DIR) at the project's own code, without virtualenvs or data folders",
            )
        )
    if confirms_off(app):
        found.append(
            _finding(
                "GA005",
                WARNING,
                "broker_transport_options",
                "RabbitMQ without publisher confirms: a publish the broker refuses (an exchange that does not "
                "exist, a message over max_message_size) returns as if it were sent; the message is lost and the "
                "refusal fails the next publish on the channel instead. The outbox relay confirms its own "
                "publishes; .delay() and .apply_async() do not",
                "set broker_transport_options = {'confirm_publish': True} (CELERY_BROKER_TRANSPORT_OPTIONS): each "
                "publish then waits for the broker's confirm (a round trip) and a refusal raises in it",
            )
        )
    placement = audit_source.read_placement(walked)
    for path, sites in sorted(_sites(placement.in_transaction).items()):
        found.append(
            _finding(
                "GA002",
                WARNING,
                path,
                f"publishes a task inside a database transaction, {_lines(sites)}: the worker can run it before "
                "the commit (the rows it reads are not there yet), or for a transaction that rolls back",
                "publish after the commit: task.delay_on_commit(...) / apply_async_on_commit(...), "
                "transaction.on_commit(lambda: task.delay(...)), or the outbox (task.enqueue_in_transaction(...)) "
                "for a message that must not be lost",
            )
        )
    for path, sites in sorted(_sites(placement.waits).items()):
        found.append(
            _finding(
                "GA003",
                WARNING,
                path,
                f"waits on a task's result, {_lines(sites)}: the caller (a request) is held until a worker has "
                "run the task, and fails when the queue is slow or the worker down",
                "return at once with the task id (202 Accepted) and let the client ask for the result later; or "
                "do the work in the request if it must finish there",
            )
        )
    for path, sites in sorted(_sites(placement.waits_in_scripts).items()):
        found.append(
            _finding(
                "GA004",
                INFO,
                path,
                f"waits on a task's result, {_lines(sites)}, in a script or management command (no request is held)",
                "fine outside a request: give each wait a timeout (result.get(timeout=...))",
            )
        )
    return found


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
    return found + redaction_rules(app, guarded)


def redaction_rules(app: Any, guarded: list[Any]) -> list[Finding]:
    """GA106, an empty ``redact_keys`` (app or task): the rule of :func:`celery_guardrails.options.weak_settings`,
    which the worker logs at start-up and ``manage.py check`` shows as guardrails.W003."""
    from celery_guardrails.options import app_settings, weak_settings

    return [
        _finding(
            "GA106",
            WARNING,
            weakness.subject,
            weakness.message,
            "leave redact_keys unset for the defaults, or list the key-name fragments to redact",
        )
        for weakness in weak_settings(app_settings(app), guarded)
    ]


def _time_limit(app: Any, task: Any) -> float | None:
    limit = task.time_limit or app.conf.task_time_limit
    return float(limit) if limit else None


# -- the retry rules: idempotency of re-runs and the retry policy (the audit's and the worker's start-up log) --


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryCode:
    """What a task function's own code shows of its ``.retry(`` calls (read with ``ast``, else its bytecode)."""

    calls: bool = False
    #: (line, countdown) of each call whose wait is fixed: a constant countdown, or None (default_retry_delay).
    fixed: tuple[tuple[int, float | None], ...] = ()
    #: A call under ``except Exception:``, ``except BaseException:`` or a bare ``except:``.
    on_any_error: bool = False
    #: The constants passed as ``max_retries=`` (None: for ever).
    max_retries: tuple[int | None, ...] = ()


_RETRY_CODE: dict[CodeType, RetryCode] = {}
#: The classes that mean "any error" in a retry policy.
BROAD = ("Exception", "BaseException")


def _broad(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        kind is None
        or (isinstance(kind, ast.Name) and kind.id in BROAD)
        or (isinstance(kind, ast.Attribute) and kind.attr in BROAD)
        for kind in kinds
    )


def _retry_calls(nodes: Iterable[ast.AST]) -> list[ast.Call]:
    return [
        node
        for top in nodes
        for node in ast.walk(top)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "retry"
    ]


def _read_retry_code(function: Any) -> RetryCode:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, ValueError, RecursionError):
        # No source (a function built at run time, a .pyc only): the bytecode shows the calls, not their waits.
        from celery_guardrails.runtime.effects import code_objects

        found = any(
            instruction.argval == "retry" and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
            for code in code_objects(function.__code__)
            for instruction in dis.get_instructions(code)
        )
        return RetryCode(calls=found)
    body = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)), tree)
    calls = _retry_calls([body])
    fixed: list[tuple[int, float | None]] = []
    max_retries: list[int | None] = []
    for call in calls:
        keywords = {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg}
        countdown = keywords.get("countdown")
        if "eta" in keywords:
            pass  # a computed time: not a fixed interval
        elif countdown is None:
            fixed.append((call.lineno, None))
        elif isinstance(countdown, ast.Constant) and isinstance(countdown.value, int | float):
            fixed.append((call.lineno, float(countdown.value)))
        limit = keywords.get("max_retries")
        if isinstance(limit, ast.Constant) and (limit.value is None or type(limit.value) is int):
            max_retries.append(limit.value)
    handlers = [node for node in ast.walk(body) if isinstance(node, ast.ExceptHandler) and _broad(node)]
    return RetryCode(
        calls=bool(calls),
        fixed=tuple(fixed),
        on_any_error=any(_retry_calls(handler.body) for handler in handlers),
        max_retries=tuple(max_retries),
    )


def retry_code(task: Any) -> RetryCode:
    """What the task function's code shows of its ``.retry(`` calls (computed once per function)."""
    from celery_guardrails.runtime.effects import body_function

    function = body_function(task)
    if not isinstance(function, FunctionType):
        return RetryCode()
    found = _RETRY_CODE.get(function.__code__)
    if found is None:
        found = _RETRY_CODE[function.__code__] = _read_retry_code(function)
    return found


def _catches_anything(kinds: Iterable[Any]) -> list[str]:
    return [
        getattr(kind, "__name__", str(kind))
        for kind in kinds
        if kind in (Exception, BaseException) or (isinstance(kind, str) and kind.rpartition(".")[2] in BROAD)
    ]


def _max_retries(kind: type) -> tuple[bool, int | None]:
    """(set by the project, the value) of max_retries, ``retry_kwargs['max_retries']`` first (Celery's order)."""
    kwargs = celery_option(kind, "retry_kwargs") or {}
    if isinstance(kwargs, dict) and "max_retries" in kwargs:
        return True, kwargs["max_retries"]
    return celery_option_set(kind, "max_retries"), celery_option(kind, "max_retries")


def _gate_fix() -> str:
    """What makes a re-run safe, in the gate's words (its dead letters and log say the same)."""
    from celery_guardrails.runtime.gate import FIX

    return FIX


def retry_rules(app: Any, tasks: list[Any]) -> list[Finding]:
    """The rules about running a body again (GA201, GA202, GA3xx) for ``tasks``: the audit's findings, and
    what a worker logs as it starts (:func:`celery_guardrails.runtime.install.warn_about`)."""
    from celery_guardrails.runtime.task import GuardedTask

    found = []
    for task in tasks:
        if isinstance(task, GuardedTask):
            found += _guarded_retries(app, task)
        else:
            found += _plain_retries(task)
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


def _guarded_retries(app: Any, task: Any) -> list[Finding]:
    from celery_guardrails.runtime.effects import marks_effects, reads_key

    found = []
    idempotent = bool(resolve(task, "idempotent", {}))
    unsafe = bool(resolve(task, "retry_unsafe", {}))
    keyed = resolve(task, "idempotency_key", {}) is not None
    if (idempotent or unsafe) and not keyed:
        found.append(
            _finding(
                "GA201",
                WARNING,
                task.name,
                "retried on unknown and ambiguous errors (idempotent or retry_unsafe) with no idempotency_key: two "
                "deliveries of one message can both act",
                'set idempotency_key="<name>:{<argument>}" so that each delivery claims the key where the effect lands',
            )
        )
    if unsafe:
        found.append(
            _finding(
                "GA301",
                ERROR,
                task.name,
                "retry_unsafe=True: run again after failures that may have acted (a read timeout, a 5xx) although "
                "not idempotent: the dependency may act twice on one message (the zero rule: the retry axis "
                "scores 0)",
                f"drop retry_unsafe and make a re-run safe: {_gate_fix()}",
            )
        )
    marks = marks_effects(task)
    if not (idempotent or unsafe or marks):
        atomic = bool(resolve(task, "atomic", {}))
        if keyed and not atomic and not reads_key(task):
            found.append(
                _finding(
                    "GA202",
                    WARNING,
                    task.name,
                    "keyed, but the key never reaches the effect: the code never reads "
                    "self.request.idempotency_key, the task is not atomic and its body marks no effect, so the key "
                    "skips a duplicate of a completed run only, and a failed run is never retried automatically",
                    "pass self.request.idempotency_key to the provider (an Idempotency-Key header) or a unique "
                    "row; or atomic=True when its effect is its own database writes; or mark the call that acts "
                    "with `with self.effect():`",
                )
            )
        elif not keyed:
            asked = _asks_for_retries(task)
            found.append(
                _finding(
                    "GA309",
                    INFO,
                    task.name,
                    "never retried automatically: not idempotent, unkeyed, and its body marks no effect, so the "
                    "retry gate counts it as one effect from its first line"
                    + (f"; {asked} cannot run it again (a final failure, not_idempotent)" if asked else ""),
                    f"for retries, {_gate_fix()}",
                )
            )
    broad = _catches_anything(
        (*(resolve(task, "transient_errors", {}) or ()), *(celery_option(type(task), "autoretry_for") or ()))
    )
    if broad:
        found.append(
            _finding(
                "GA307",
                WARNING,
                task.name,
                f"retried on any error: {', '.join(sorted(set(broad)))} in transient_errors or autoretry_for: every "
                "error that is not deterministic (a bug, a refusal) is classified transient",
                "name the transient errors (ConnectionError, TimeoutError, the client's retryable errors) instead "
                "of Exception",
            )
        )
    attempts = resolve(task, "max_attempts", {})
    if isinstance(attempts, int) and attempts > MAX_RETRIES + 1:
        found.append(
            _finding(
                "GA308",
                WARNING,
                task.name,
                f"max_attempts={attempts}: up to {attempts} runs of one message",
                f"keep max_attempts at {MAX_RETRIES + 1} or fewer (the default is 5); a retry budget per "
                "dependency keeps an outage from eating the workers",
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
    return found


def _asks_for_retries(task: Any) -> str:
    """What of Celery's retry settings a guarded task uses, for GA309: its autoretry_for, its self.retry()."""
    asked = []
    if celery_option(type(task), "autoretry_for"):
        asked.append("its autoretry_for")
    if retry_code(task).calls:
        asked.append("its self.retry()")
    return " and ".join(asked)


def _plain_retries(task: Any) -> list[Finding]:
    kind = type(task)
    code = retry_code(task)
    autoretry = tuple(celery_option(kind, "autoretry_for") or ())
    limit_set, limit = _max_retries(kind)
    why = []
    if autoretry:
        why.append(f"autoretry_for=({', '.join(getattr(k, '__name__', str(k)) for k in autoretry)},)")
    if celery_option_set(kind, "max_retries"):
        why.append(f"max_retries={celery_option(kind, 'max_retries')!r}")
    if celery_option(kind, "retry_kwargs"):  # an empty dict asks for nothing
        why.append(f"retry_kwargs={celery_option(kind, 'retry_kwargs')!r}")
    if code.calls:
        why.append(".retry( in its code")
    if not why:
        return []
    found = [
        _finding(
            "GA305",
            ERROR,
            task.name,
            f"a plain Celery task retried automatically ({', '.join(why)}): Celery runs it again whatever it did "
            "before it failed (no retry gate), so a charge or a mail can happen twice (the zero rule: the retry "
            "axis scores 0)",
            f"make it a GuardedTask (base=GuardedTask: its autoretry_for and self.retry() then pass the retry "
            f"gate) and {_gate_fix()}; or remove its retries",
        )
    ]
    default = celery_option(kind, "default_retry_delay")
    default = float(default if default is not None else CELERY_RETRY_DELAY)
    fixed = [
        f"self.retry() on line {line} waits "
        + (f"{wait:g} s" if wait is not None else f"default_retry_delay {default:g} s")
        for line, wait in code.fixed
    ]
    if autoretry and not celery_option(kind, "retry_backoff"):
        kwargs = celery_option(kind, "retry_kwargs") or {}
        delay = kwargs.get("countdown") if isinstance(kwargs, dict) else None
        fixed.insert(0, f"autoretry_for waits {float(delay) if delay is not None else default:g} s each time")
    if fixed:
        found.append(
            _finding(
                "GA306",
                WARNING,
                task.name,
                f"retried at a fixed interval ({'; '.join(fixed)}): every message that failed in an outage comes "
                "back at once, in step",
                "set retry_backoff=True (Celery adds jitter), or compute the countdown from self.request.retries; "
                "a GuardedTask backs off with jitter by itself",
            )
        )
    broad = _catches_anything(autoretry)
    if broad or code.on_any_error:
        shown = f"autoretry_for names {', '.join(sorted(set(broad)))}" if broad else "self.retry() under a broad except"
        found.append(
            _finding(
                "GA307",
                WARNING,
                task.name,
                f"retried on any error ({shown}): a bug or bad input is retried like an outage",
                "retry the transient errors only (ConnectionError, TimeoutError, the client's retryable errors)",
            )
        )
    limits = [value for value in (limit,) if limit_set] + list(code.max_retries)
    high = [value for value in limits if value is None or value > MAX_RETRIES]
    if high:
        worst = "None (for ever)" if None in high else str(max(value for value in high if value is not None))
        found.append(
            _finding(
                "GA308",
                WARNING,
                task.name,
                f"max_retries={worst}: a message that cannot succeed keeps a worker busy "
                + ("for ever" if None in high else f"for {worst} more runs"),
                f"keep max_retries at {MAX_RETRIES} or fewer (a GuardedTask: max_attempts, default 5, and a retry "
                "budget per dependency)",
            )
        )
    return found


def _mail_recipients_missing(app: Any, guarded: list[Any]) -> str | None:
    """Why mail alerts reach nobody, or None when they reach someone."""
    from celery_guardrails.operations.alerts import _django_configured
    from celery_guardrails.runtime.outcomes import owner_of

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


def owner_rules(guarded: list[Any]) -> list[Finding]:
    """GA401, a guarded task with no owner: the audit's finding, and the worker's start-up warning
    (:func:`celery_guardrails.runtime.install.warn_about` names them all on one line)."""
    from celery_guardrails.runtime.outcomes import owner_of

    return [
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


def _dead_letters(app: Any, guarded: list[Any]) -> list[Finding]:
    found = owner_rules(guarded)
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


def visibility_rules(app: Any, tasks: list[Any]) -> list[Finding]:
    """GA501, on a Redis broker (any URL form, Sentinel's too: :func:`celery_guardrails.broker.kind.broker_kind`):
    a guarded task's ``backoff_max`` or ``retry_later_delay * retry_later_max``, or (``acks_late``, no
    ``broker_lease``) a task's ``time_limit``, not shorter than the transport's ``visibility_timeout``. The audit's
    finding, and the worker's start-up warning (:func:`celery_guardrails.runtime.install.warn_about`)."""
    from celery_guardrails.broker.delays import visibility_timeout
    from celery_guardrails.broker.kind import broker_kind
    from celery_guardrails.runtime.task import GuardedTask

    if not broker_kind(app).redis:
        return []
    found = []
    visibility = visibility_timeout(app)
    lease = app_value(app, "broker_lease")
    for task in tasks:
        longer = []
        if isinstance(task, GuardedTask):
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
    return found


def consumer_timeout_rules(app: Any, guarded: list[Any]) -> list[Finding]:
    """GA504, RabbitMQ: a guarded task whose ``time_limit`` is unset or longer than the consumer timeout the app
    declares. The rule of :func:`celery_guardrails.broker.lease.long_holders`, which the worker logs at start-up
    (one line naming them all)."""
    from celery_guardrails.broker.lease import long_holders

    found = long_holders(app, guarded)
    if found is None:
        return []
    return [
        _finding(
            "GA504",
            WARNING,
            name,
            f"its time_limit is unset or longer than RabbitMQ's consumer_timeout ({found.timeout:g} s): RabbitMQ "
            "closes the channel of a delivery held longer and delivers its messages again",
            "set time_limit below it, or raise consumer_timeout (rabbitmq.conf, or the queue argument "
            "x-consumer-timeout) and rabbitmq_consumer_timeout with it",
        )
        for name in found.tasks
    ]


def startup_rules(app: Any) -> list[Finding]:
    """The audit's rules a worker logs as it starts (:func:`celery_guardrails.runtime.install.warn_about`), for
    the app's graded tasks: the retry rules (GA201, GA202, GA3xx), the visibility rule (GA501) and the redaction
    rule (GA106). The owner rule (GA401) is logged there too, as one line naming every task."""
    tasks = graded_tasks(app)
    from celery_guardrails.runtime.task import GuardedTask

    guarded = [task for task in tasks if isinstance(task, GuardedTask)]
    return retry_rules(app, tasks) + visibility_rules(app, tasks) + redaction_rules(app, guarded)


def _ordering_concurrency(app: Any, tasks: list[Any], guarded: list[Any]) -> list[Finding]:
    found = visibility_rules(app, tasks)
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
    found += consumer_timeout_rules(app, guarded)
    return found


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
    from celery_guardrails.stores import django_apps_installed

    if not django_apps_installed("django_celery_beat"):
        return None
    try:
        from django_celery_guardrails.schedulers import periodic_task_rows

        enabled, disabled, _ = periodic_task_rows(app, names=None)
    except Exception:  # no table yet, no database: the rows are not graded (an audit never raises)
        return None
    return {**disabled, **enabled}


def _scheduled_work(app: Any) -> list[Finding]:
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
                _finding(
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
                        _finding(
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
                _finding(
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
                _finding(
                    "GA602",
                    WARNING,
                    name,
                    f"a crontab whose policy states no timezone: read in the app's zone ({app.conf.timezone or 'UTC'})",
                    f'set schedules["{name}"]["timezone"] (an IANA name such as "Europe/Berlin")',
                )
            )
        if not policy.default and task is not None and not hasattr(task, "guardrails"):
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
    if rows is not None or not _django_beat_installed():
        for name in sorted(n for n, policy in policies.items() if policy is not None and n not in every):
            found.append(
                _finding(
                    "GA604",
                    ERROR,
                    name,
                    "a schedules policy for a beat entry that does not exist: the worker and beat refuse to start",
                    f'add "{name}" to beat_schedule (or a PeriodicTask of that name), or remove its policy',
                )
            )
    if (policies or every) and not app_value(app, "watchdog"):
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
        from celery_guardrails.operations import metrics

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


def _first_helper(task: Any) -> str:
    """The kit's helper a task's first test starts with: the rubric's case its options are about."""
    from celery_guardrails.runtime.effects import body_function

    function = body_function(task)
    name = getattr(function, "__name__", None) or task.name.rpartition(".")[2]
    if resolve(task, "ordering_key", {}) is not None:
        return f"out_of_order({name}, [...]) (messages of one key delivered out of order)"
    if resolve(task, "accepts_versions", {}) is not None:
        return f"deploy_during_processing({name}, old=Release(...), new=Release(...)) (a deployment mid-queue)"
    return (
        f"deliver_twice({name}, ...) with assert_single_effect (a duplicate delivery), then crash_mid_task and poison"
    )


def _named_in(task: Any, names: frozenset[str]) -> bool:
    """Whether ``names`` (a kit test file's) name the task: its full name, the last part of it, its class, or its
    function (not a class-based task's ``run``, which names nothing)."""
    from celery_guardrails.runtime.effects import body_function

    function = getattr(body_function(task), "__name__", None)
    candidates = {task.name, task.name.rpartition(".")[2], type(task).__name__}
    if function and function != "run":
        candidates.add(function)
    return bool(candidates & names)


def _tests(guarded: list[Any], walked: audit_source.Walk) -> list[Finding]:
    if not guarded:
        return []  # no guarded task, nothing for the kit to prove (GA101 names the plain ones)
    found = []
    if not walked.complete:
        found.append(
            _finding(
                "GA809",
                INFO,
                "tests",
                f"the tests under {walked.root} were not read whole ({walked.why_incomplete}): what was not read "
                "is not graded",
                "point --source at the project, without virtualenvs or data folders",
            )
        )
    count, kit_files = audit_source.read_tests(walked)
    if not kit_files:
        seen = f"none of the {count} test files" if count else "no test file"
        found.append(
            _finding(
                "GA801",
                ERROR,
                "tests",
                f"{seen} under {walked.root} uses the test kit (celery_guardrails.testing): no test delivers a "
                "guarded task twice, kills it mid-task or poisons it",
                "add tests marked @pytest.mark.guardrails that call the kit's helpers (from "
                "celery_guardrails.testing import deliver_twice, crash_mid_task, poison, ...): docs/testing.md",
            )
        )
    names = frozenset().union(*(kit_file.names for kit_file in kit_files))
    for task in guarded:
        if not _named_in(task, names):
            found.append(
                _finding(
                    "GA802",
                    WARNING,
                    task.name,
                    "no test that uses the test kit names it: its behaviour on the rubric's bad days is not shown",
                    f"start with {_first_helper(task)}, in a test marked @pytest.mark.guardrails",
                )
            )
    return found


def render(report: Report, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> str:
    """The report as text: per axis its score and findings, each with its fix; the average; then the verdict."""
    lines = []
    for axis in report.axes:
        lines.append(f"{axis.title}: {axis.score}/{TOP}")
        for finding in axis.findings:
            lines.append(f"  {finding.code} {finding.severity:<7} {finding.subject}: {finding.message}")
            lines.append(f"        fix: {finding.fix}")
    lines.append(f"average: {report.average:.2f}/{TOP} over {len(report.axes)} axes")
    if report.source is not None:
        tests = "" if report.tests_source == report.source else f"; tests read under {report.tests_source}"
        lines.append(f"source read under {report.source}{tests}")
    failures = report.failures(min_score=min_score, min_average=min_average)
    if failures:
        lines.append("FAIL: " + "; ".join(failures))
    else:
        lines.append(
            f"OK: every axis scores {min_score} or more (lowest {report.lowest}), and the average "
            f"{report.average:.2f} is {min_average} or more"
        )
    return "\n".join(lines)


def as_json(report: Report, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> str:
    """The report as JSON, with the threshold and whether it passed."""
    data = report.as_dict()
    data["min_score"] = min_score
    data["min_average"] = min_average
    data["passed"] = report.passed(min_score=min_score, min_average=min_average)
    return json.dumps(data, indent=2)


__all__ = [
    "AXES",
    "MIN_AVERAGE",
    "MIN_SCORE",
    "ZERO_RULE",
    "Axis",
    "Finding",
    "Report",
    "RetryCode",
    "as_json",
    "audit",
    "graded_tasks",
    "render",
    "report_of",
    "retry_code",
    "retry_rules",
    "source_walks",
]
