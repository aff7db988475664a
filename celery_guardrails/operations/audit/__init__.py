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
    GA006 warning  the Django store on a database server whose connections Celery's Django fixup closes before
                   and after every task (no ``CELERY_DB_REUSE_MAX``; no Django pool, or the prefork pool, which
                   closes the pool with every task: celery/celery#10554): a new connection per guarded task
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
    GA203 warning  ``atomic=True`` without ``idempotency_key``: ``atomic`` commits a key with the body's writes,
                   so with no key the body runs in no transaction (a failure keeps what it wrote)
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
retry rules (GA201, GA202, GA203, GA3xx: :func:`retry_rules`), the visibility rule (GA501: :func:`visibility_rules`),
the redaction rule (GA106: :func:`redaction_rules`), the connection rule (GA006: :func:`connection_rules`,
for the worker's own pool), the owner rule (GA401: :func:`owner_rules`) and, from its
consumer, the RabbitMQ consumer-timeout rule (GA504: :func:`consumer_timeout_rules`), so what a
worker warns about and what the audit grades is one rule, written once, with one threshold.

The package, by cohesion: :mod:`~.model` (findings, axes, the score, the report), :mod:`~.grading` (:func:`audit`,
:func:`startup_rules`, the folders read), :mod:`~.rendering` (text and JSON), :mod:`~.tasks` (which tasks are
graded), and one module of rules per axis: :mod:`~.placement`, :mod:`~.message_design`, :mod:`~.retries` (with
:mod:`~.retry_calls`, what a task's code shows of its ``.retry(`` calls), :mod:`~.dead_letters`,
:mod:`~.ordering`, :mod:`~.scheduling`, :mod:`~.observability`, :mod:`~.kit_use`. Every name is imported from
here, as before the split.
"""

from celery_guardrails.operations.audit.dead_letters import owner_rules
from celery_guardrails.operations.audit.grading import audit, source_walks, startup_rules
from celery_guardrails.operations.audit.message_design import redaction_rules
from celery_guardrails.operations.audit.model import (
    AXES,
    AXIS_OF_DIGIT,
    COST,
    ERROR,
    INFO,
    MIN_AVERAGE,
    MIN_SCORE,
    TITLES,
    TOP,
    WARNING,
    ZERO_RULE,
    Axis,
    Finding,
    Report,
    report_of,
)
from celery_guardrails.operations.audit.ordering import LONG_TASK, consumer_timeout_rules, visibility_rules
from celery_guardrails.operations.audit.placement import SHOWN_SITES, connection_rules
from celery_guardrails.operations.audit.rendering import as_json, render
from celery_guardrails.operations.audit.retries import CELERY_RETRY_DELAY, MAX_RETRIES, retry_rules
from celery_guardrails.operations.audit.retry_calls import BROAD, RetryCode, retry_code
from celery_guardrails.operations.audit.tasks import SKIPPED_PREFIXES, graded_tasks

__all__ = [
    "AXES",
    "AXIS_OF_DIGIT",
    "BROAD",
    "CELERY_RETRY_DELAY",
    "COST",
    "ERROR",
    "INFO",
    "LONG_TASK",
    "MAX_RETRIES",
    "MIN_AVERAGE",
    "MIN_SCORE",
    "SHOWN_SITES",
    "SKIPPED_PREFIXES",
    "TITLES",
    "TOP",
    "WARNING",
    "ZERO_RULE",
    "Axis",
    "Finding",
    "Report",
    "RetryCode",
    "as_json",
    "audit",
    "connection_rules",
    "consumer_timeout_rules",
    "graded_tasks",
    "owner_rules",
    "redaction_rules",
    "render",
    "report_of",
    "retry_code",
    "retry_rules",
    "source_walks",
    "startup_rules",
    "visibility_rules",
]
