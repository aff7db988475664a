"""Guardrails stores: where state shared by every worker lives (see :mod:`celery_guardrails.stores.base`).

The ``store`` setting picks one: ``"django"`` (the Django app's tables) or a Redis URL. Unset, it is
``"django"`` when ``django_celery_guardrails`` is an installed Django app, else the broker's URL when the
broker is Redis.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import app_settings
from celery_guardrails.stores.base import Store


def _django_app_installed() -> bool:
    try:
        from django.apps import apps
    except ImportError:
        return False
    return apps.ready and apps.is_installed("django_celery_guardrails")


def store_url(app: Any) -> str:
    """The store setting of ``app``, with the default applied."""
    configured = app_settings(app).get("store")
    if configured:
        return str(configured)
    if _django_app_installed():
        return "django"
    broker = str(app.conf.broker_url or "")
    if broker.startswith(("redis://", "rediss://")):
        return broker
    raise ConfigurationError("store", "no store: set it to 'django' or a Redis URL (the broker is not Redis)")


def get_store(app: Any) -> Store:
    """The store of ``app`` (one instance per app and setting)."""
    url = store_url(app)
    cached = getattr(app, "_guardrails_store", None)
    if cached is not None and cached[0] == url:
        return cached[1]  # type: ignore[no-any-return]
    store: Store
    if url == "django":
        from django_celery_guardrails.store import DjangoStore

        store = DjangoStore()
    else:
        from celery_guardrails.stores.redis import RedisStore

        store = RedisStore(url)
    app._guardrails_store = (url, store)
    return store
