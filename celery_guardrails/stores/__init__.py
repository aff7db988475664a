"""Guardrails stores: where state shared by every worker lives (see :mod:`celery_guardrails.stores.base`).

The ``store`` setting picks one: ``"django"`` (the Django app's tables) or a Redis URL (one server, a
Redis Cluster or Sentinel: see :mod:`~celery_guardrails.stores.redis_client`). Unset, it is ``"django"`` when
``django_celery_guardrails`` is an installed Django app, else the broker's URL when the broker is Redis (a
``sentinel://`` broker with the ``master_name`` of its transport options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import APP, Option, app_settings, app_value, checks, declare
from celery_guardrails.stores.base import Store
from celery_guardrails.stores.redis_client import SCHEMES, check_url


def redis_url(value: str) -> str:
    """``value`` if the store can connect with it; the errors show it masked (it may hold a password)."""
    try:
        check_url(checks.masked(value))  # the same shape with the secrets out: what is wrong is said the same way
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return value


def _store(value: Any) -> str:
    if value == "django" or (isinstance(value, str) and value.startswith(SCHEMES)):
        return value if value == "django" else redis_url(value)
    shown = f"{checks.masked(value)!r:.80}" if isinstance(value, str) else checks.kind(value)
    raise ValueError(f"must be 'django' or a Redis URL such as 'redis://127.0.0.1:6379/1', got {shown}")


#: The options the stores read, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="store_timeout",
        default=5.0,
        doc="Seconds a Redis store connection may take to connect or answer before the store counts as "
        "unavailable (a half-open connection would stall heartbeats). For the Django store, set the "
        "database's own connect and statement timeouts.",
        check=checks.seconds,
        scopes=frozenset({APP}),
    ),
    Option(
        name="store",
        default=None,
        doc="Where budgets and circuit states live: 'django' (the Django app's tables) or a Redis URL: one "
        "server (redis://, rediss://, unix://), a Redis Cluster (redis+cluster://host:7000) or Sentinel "
        "(sentinel://host:26379/1?master_name=mymaster). Default: 'django' when the Django app is "
        "installed, else the broker's Redis (a sentinel:// broker with its master_name transport option).",
        check=_store,
        scopes=frozenset({APP}),
    ),
)


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
    from celery_guardrails.broker.kind import kind_of_url

    kind = kind_of_url(app.conf.broker_url)
    broker = ";".join(kind.urls)
    # A Redis broker whose URL the store's client reads as it is (redis-py's grammar): not kombu's redis+socket://
    # (set the store to its unix:// form), and Sentinel only with the master's name, below.
    if kind.scheme in ("redis", "rediss"):
        return broker
    master = (app.conf.broker_transport_options or {}).get("master_name")
    if kind.sentinel and master:
        # Celery takes the master's name from the transport options; the store's URL carries it.
        joiner = "&" if "?" in broker else "?"
        return broker if "master_name=" in broker else f"{broker}{joiner}master_name={quote(master, safe='')}"
    raise ConfigurationError("store", "no store: set it to 'django' or a Redis URL (the broker is not Redis)")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Made:
    """The store made for an app, and the setting it was made for (a changed setting makes a new one)."""

    url: str
    store: Store


#: Stores the core does not make itself, by name (``"django"``: registered by the Django app when it is ready).
_STORE_MAKERS: dict[str, Callable[[], Store]] = {}


def register_store(name: str, make: Callable[[], Store]) -> None:
    """Make the store ``name`` of the ``store`` setting with ``make`` (the Django app registers ``"django"`` in its
    ``ready()``: the core does not import it)."""
    _STORE_MAKERS[name] = make


def get_store(app: Any) -> Store:
    """The store of ``app`` (one instance per app and setting)."""
    url = store_url(app)
    made = getattr(app, "_guardrails_store", None)
    if isinstance(made, _Made) and made.url == url:
        return made.store
    store: Store
    if url == "django":
        make = _STORE_MAKERS.get(url)
        if make is None:
            raise ConfigurationError(
                "store",
                "the 'django' store needs the Django app django_celery_guardrails in INSTALLED_APPS, set up "
                "(django.setup(), which a Django project's worker and web process do)",
            )
        store = make()
    else:
        from celery_guardrails.stores.redis import RedisStore

        store = RedisStore(url, timeout=app_value(app, "store_timeout"))
    app._guardrails_store = _Made(url=url, store=store)
    return store
