"""Loading a callable given as a dotted path (``"package.module.attr"``), for options that take one."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from celery_guardrails.exceptions import ConfigurationError


def load(value: Any) -> Any:
    """A callable given as a callable or as a dotted path ``package.module.attr``."""
    if not isinstance(value, str):
        return value
    module_name, _, attr = value.rpartition(".")
    try:
        return getattr(import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(value, f"cannot import {value!r}: {exc}") from None
