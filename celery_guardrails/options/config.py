"""The app config: the ``guardrails`` mapping of a Celery app (``CELERY_GUARDRAILS`` in Django), read in this
module only and validated against the schema, and the one checker every setting goes through.

:func:`validate` refuses an unknown key (with a "did you mean"), a key set where it may not be (its scope) and a
bad value, each as :class:`~celery_guardrails.exceptions.ConfigurationError` naming the key.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options.schema import APP, CALL, OPTIONS


def _unknown(key: str, known: Any) -> ConfigurationError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigurationError(key, "unknown key" + hint)


def checked(key: str, value: Any) -> Any:
    """``value`` checked by option ``key``'s check; a refusal is a ConfigurationError naming the key."""
    try:
        return OPTIONS[key].check(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(key, str(exc)) from None


def validate(raw: Any, *, scope: str = APP) -> dict[str, Any]:
    """Check a mapping of options for ``scope``; return the checked values (unset keys are absent)."""
    if not raw:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigurationError("guardrails", f"must be a dict, got {type(raw).__name__}")
    known = [name for name, option in OPTIONS.items() if scope in option.scopes]
    values = {}
    for key, value in raw.items():
        if key not in known:
            if key in OPTIONS:
                raise ConfigurationError(key, f"cannot be set in {scope} scope")
            raise _unknown(str(key), known)
        values[key] = checked(key, value)
    return values


def check_call_options(call: Mapping[str, Any]) -> dict[str, Any]:
    """Validate per-call options given to ``apply_async``."""
    return validate(call, scope=CALL)


_snapshot: ContextVar[tuple[Any, dict[str, Any]] | None] = ContextVar("guardrails_settings", default=None)


class settings_snapshot:  # lower case: used like the function it replaced, ``with settings_snapshot(app):``
    """Read the app config once for a block: a publish, a task run, a hook (Celery's config lookups are
    slow enough to show in the per-task cost when every option is looked up again). A class rather than a
    generator: it is entered several times per task."""

    __slots__ = ("app", "token")

    def __init__(self, app: Any) -> None:
        self.app = app

    def __enter__(self) -> None:
        self.token = _snapshot.set((self.app, app_settings(self.app, fresh=True)))

    def __exit__(self, *exc_info: object) -> None:
        _snapshot.reset(self.token)


def app_settings(app: Any, *, fresh: bool = False) -> dict[str, Any]:
    """The validated ``guardrails`` mapping of a Celery app (cached until the mapping is replaced)."""
    snapshot = None if fresh else _snapshot.get()
    if snapshot is not None and snapshot[0] is app:
        return snapshot[1]
    raw = app.conf.get("guardrails")
    cached = getattr(app, "_guardrails_settings", None)
    if cached is not None and cached[0] is raw:
        return cached[1]  # type: ignore[no-any-return]
    values = validate(raw)
    app._guardrails_settings = (raw, values)
    return values


def django_settings() -> dict[str, Any]:
    """The validated ``CELERY_GUARDRAILS`` of the Django settings (Django imported only when called)."""
    from django.conf import settings

    return validate(getattr(settings, "CELERY_GUARDRAILS", None))
