"""Guardrails stores: where state shared by every worker lives (see :mod:`celery_guardrails.stores.base`).

The ``store`` setting picks one: ``"django"`` (the Django app's tables) or a Redis URL (one server, a
Redis Cluster or Sentinel: see :mod:`~celery_guardrails.stores.redis_client`). Unset, it is ``"django"`` when
``django_celery_guardrails`` is an installed Django app, else the broker's URL when the broker is Redis (a
``sentinel://`` broker with the ``master_name`` of its transport options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import app_settings, app_value
from celery_guardrails.stores.base import Store


def django_apps_installed(*names: str) -> bool:
    """Whether Django is set up with the guardrails app and every app in ``names`` installed."""
    try:
        from django.apps import apps
    except ImportError:
        return False
    return apps.ready and all(apps.is_installed(name) for name in ("django_celery_guardrails", *names))


def store_url(app: Any) -> str:
    """The store setting of ``app``, with the default applied."""
    configured = app_settings(app).get("store")
    if configured:
        return str(configured)
    if django_apps_installed():
        return "django"
    broker = str(app.conf.broker_url or "")
    if broker.startswith(("redis://", "rediss://")):
        return broker
    master = (app.conf.broker_transport_options or {}).get("master_name")
    if broker.startswith("sentinel://") and master:
        # Celery takes the master's name from the transport options; the store's URL carries it.
        joiner = "&" if "?" in broker else "?"
        return broker if "master_name=" in broker else f"{broker}{joiner}master_name={quote(master, safe='')}"
    raise ConfigurationError("store", "no store: set it to 'django' or a Redis URL (the broker is not Redis)")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Made:
    """The store made for an app, and the setting it was made for (a changed setting makes a new one)."""

    url: str
    store: Store


def get_store(app: Any) -> Store:
    """The store of ``app`` (one instance per app and setting)."""
    url = store_url(app)
    made = getattr(app, "_guardrails_store", None)
    if isinstance(made, _Made) and made.url == url:
        return made.store
    store: Store
    if url == "django":
        from django_celery_guardrails.store import DjangoStore

        store = DjangoStore()
    else:
        from celery_guardrails.stores.redis import RedisStore

        store = RedisStore(url, timeout=app_value(app, "store_timeout"))
    app._guardrails_store = _Made(url=url, store=store)
    return store
