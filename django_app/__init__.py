"""The Django app of celery-guardrails (``django_celery_guardrails``, app label ``guardrails``).

Add ``"django_celery_guardrails"`` to ``INSTALLED_APPS`` and
``"django_celery_guardrails.middleware.GuardrailsContextMiddleware"`` to ``MIDDLEWARE``.
"""
