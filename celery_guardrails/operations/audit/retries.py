"""The retry rules (GA201, GA202, GA203, GA3xx): the idempotency and retry-policy axes, about running a body again. A
guarded task retried on ambiguous errors with no key, or with ``retry_unsafe`` (the zero rule); a key that never
reaches its effect; a plain Celery task retried at all (the zero rule), at a fixed interval, on any error or
without end; ``acks_late`` without ``reject_on_worker_lost``. :func:`retry_rules` is both the audit's and what a
worker logs as it starts (:func:`celery_guardrails.runtime.install.warn_about`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery_guardrails.operations.audit.model import ERROR, INFO, WARNING, Finding, finding
from celery_guardrails.operations.audit.retry_calls import BROAD, retry_code
from celery_guardrails.operations.audit.tasks import time_limit
from celery_guardrails.options import TaskOptions, celery_option, celery_option_set, resolve

#: Retries above which a policy counts as very high (GA308); a guarded task's max_attempts counts one run more.
MAX_RETRIES = 10
#: Celery's Task.default_retry_delay, seconds: the wait of a retry that names none.
CELERY_RETRY_DELAY = 180.0


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
    from celery_guardrails.runtime.pipeline import is_guarded

    found = []
    for task in tasks:
        if is_guarded(task):
            found += _guarded_retries(app, task)
        else:
            found += _plain_retries(task)
        if task.acks_late and not task.reject_on_worker_lost:
            found.append(
                finding(
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
            finding(
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
            finding(
                "GA301",
                ERROR,
                task.name,
                "retry_unsafe=True: run again after failures that may have acted (a read timeout, a 5xx) although "
                "not idempotent: the dependency may act twice on one message (the zero rule: the retry axis "
                "scores 0)",
                f"drop retry_unsafe and make a re-run safe: {_gate_fix()}",
            )
        )
    atomic = bool(resolve(task, "atomic", {}))
    if atomic and not keyed:
        found.append(
            finding(
                "GA203",
                WARNING,
                task.name,
                "atomic=True without an idempotency_key does nothing: atomic commits a key with the body's database "
                "writes, so with no key the body runs in no transaction, and a failure keeps what it wrote",
                'set idempotency_key="<name>:{<argument>}" (the body then runs in one transaction with its key), or '
                "drop atomic=True and open `with transaction.atomic():` in the body",
            )
        )
    marks = marks_effects(TaskOptions(task=task))
    if not (idempotent or unsafe or marks):
        if keyed and not atomic and not reads_key(task):
            found.append(
                finding(
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
                finding(
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
            finding(
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
            finding(
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
            finding(
                "GA302",
                WARNING,
                task.name,
                "acks_late is off: the message is acked before the task ran, and lost if its worker dies",
                "remove acks_late=False (GuardedTask acks late)",
            )
        )
    if time_limit(app, task) and not (task.soft_time_limit or app.conf.task_soft_time_limit):
        found.append(
            finding(
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
        finding(
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
            finding(
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
            finding(
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
            finding(
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
