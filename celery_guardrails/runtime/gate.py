"""The retry gate: may a failed delivery's body run again? One answer for every automatic re-run.

Every path that would run a body again asks here: a failure classified transient
(:mod:`celery_guardrails.runtime.classification`), Celery's own ``autoretry_for`` / ``retry_backoff`` and
``self.retry()`` (both taken into the Retries guardrail, :mod:`celery_guardrails.guardrails.retries`), and a
hard time limit (:mod:`celery_guardrails.runtime.request`). ``TransientError`` and ``RetryLater`` raised by the body are
its author's own word and are not asked; deterministic errors never get this far (they are permanent).

Running the body again is safe, in this order, when:

1. the task is ``idempotent=True``: declared harmless to run twice;
2. the task is ``retry_unsafe=True``: its author accepts that it may act twice (the audit scores that 0);
3. it is keyed and its body read ``self.request.idempotency_key`` before it failed (and before any
   ``effect()`` block completed): it handed the key downstream (a provider, a unique row), so the effect cannot
   land twice;
4. it is keyed and ``atomic=True``, and no ``effect()`` block completed: its database work rolled back with
   the key (an effect it marked is outside that transaction);
5. its body marks its effects (:mod:`celery_guardrails.runtime.effects`) and none had happened when it failed.

Anything else is not safe: the failure is final (``not_idempotent``), with a note saying what would make it
retryable. A body that marks nothing counts as one effect from its first line.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_guardrails.options import APP, TASK, Option, TaskOptions, checks, declare
from celery_guardrails.runtime.delivery import Delivery
from celery_guardrails.runtime.effects import marks_effects

#: What the author of a task that is not safe to retry can do about it (the dead letter and the log say it), by
#: the reason it was not: its body marks nothing, it failed after an effect, its key never went downstream.
FIX_UNMARKED = (
    "mark the call that acts with `with self.effect():` (failures before it are then retried), hand "
    "self.request.idempotency_key to the provider or a unique row, or declare idempotent=True if running it "
    "twice is harmless"
)
FIX_AFTER_EFFECT = (
    "hand self.request.idempotency_key to the provider before its effect (a retry then presents the same key), "
    "move the work after the effect into a task of its own (chain it), or declare idempotent=True if running it "
    "twice is harmless"
)
FIX_KEY_KEPT = (
    "hand self.request.idempotency_key to the provider or a unique row, set atomic=True when the effect is in "
    "the database, or mark the call that acts with `with self.effect():`"
)
#: Every fix, for documentation and tests.
FIX = FIX_UNMARKED


#: The options the retry gate reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="idempotent",
        default=False,
        doc="Declare the task safe to run twice: any transient or unknown error is then retried, whatever "
        "the body did before it (see celery_guardrails.runtime.gate).",
        check=checks.boolean,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="retry_unsafe",
        default=False,
        doc="Let a task that is not idempotent be retried on ambiguous failures too (a read timeout, a 5xx, "
        "an error after an effect): it may then act twice. The audit scores it 0; warned about at start-up.",
        check=checks.boolean,
        scopes=frozenset({TASK, APP}),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Safety:
    """The gate's answer: whether the body may run again, why, and (when not) what would make it retryable."""

    safe: bool
    why: str
    fix: str = ""

    @property
    def note(self) -> str:
        """What the dead letter of an unsafe failure tells its owner."""
        return self.why if self.safe else f"not retried: {self.why}; to make it retryable, {self.fix}"


def declared(options: TaskOptions) -> Safety | None:
    """Rules 1, 2 and (keyed, atomic) 4 of the module docstring: what the task's options alone make safe."""
    if options["idempotent"]:
        return Safety(safe=True, why="idempotent=True")
    if options["retry_unsafe"]:
        return Safety(safe=True, why="retry_unsafe=True")
    return None


def judge(options: TaskOptions, state: Delivery) -> Safety:
    """May the body of the delivery ``state`` describes run again after its failure? (the module docstring)"""
    safety = declared(options)
    if safety is not None:
        return safety
    if state.key is not None and state.key_read_at == 0:
        return Safety(safe=True, why="its idempotency key was handed downstream before any effect")
    atomic = state.key is not None and bool(options["atomic"])
    if atomic and state.effects == 0:
        return Safety(safe=True, why="atomic=True: its database work rolled back with its key")
    if state.effects:
        return Safety(
            safe=False, why=f"it failed after {_blocks(state.effects)} that may have acted", fix=FIX_AFTER_EFFECT
        )
    if atomic or marks_effects(options):
        return Safety(safe=True, why="it failed before its first effect")
    if state.key is not None:
        return Safety(
            safe=False,
            why="its body marks no effect and never handed its idempotency key downstream (the key guards a "
            "completed run, not a failed one)",
            fix=FIX_KEY_KEPT,
        )
    return Safety(safe=False, why="its body marks no effect, so it counts as one from its first line", fix=FIX_UNMARKED)


def after_kill(options: TaskOptions, *, keyed: bool) -> Safety:
    """The gate for a body killed by its hard time limit: the worker's main process cannot see what the killed
    process did, so only the task's options can make it safe (its database transaction died with it)."""
    safety = declared(options)
    if safety is not None:
        return safety
    if keyed and options["atomic"]:
        return Safety(safe=True, why="atomic=True: its database work died with its process")
    return Safety(
        safe=False,
        why="it was killed mid-body, and what it did by then is not known",
        fix="declare idempotent=True if running it twice is harmless, or key it with atomic=True",
    )


def _blocks(count: int) -> str:
    return "an effect() block" if count == 1 else f"{count} effect() blocks"


__all__ = ["FIX", "FIX_AFTER_EFFECT", "FIX_KEY_KEPT", "FIX_UNMARKED", "Safety", "after_kill", "declared", "judge"]
