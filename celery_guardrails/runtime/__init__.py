"""The task runtime: :class:`~celery_guardrails.runtime.task.GuardedTask` and the worker's request, one
delivery's state, the hook pipeline, the outcomes that end a delivery (re-publish, fail finally), the header
contract, error classification, backoff, the retry gate and marked effects, dead-letter records, result
redaction, resumable checkpoints, the outbox relay, and the wiring into a Celery app.
"""
