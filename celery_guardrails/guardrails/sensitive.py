"""Sensitive names: the argument and key names refused at publish by default (``sensitive_keys``), how a name is
matched against them (by its words), and the start-up rule that a key template may not name one.

The payload contract (:mod:`celery_guardrails.guardrails.contract`) refuses a publish whose arguments carry a
sensitive name; a key template (``idempotency_key``, ``concurrency_key``, ``exclusive_key``, ``ordering_key``)
is stored in clear, so one that names a secret is refused when the task's options are validated
(:func:`check_key_templates`, registered with :func:`~celery_guardrails.options.task_check`).
"""

from __future__ import annotations

import functools
import re
from string import Formatter
from typing import Any

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.options import resolve, task_attribute, task_check

#: Names refused as arguments or keys by default (sensitive_keys): secrets and payment data.
SENSITIVE_KEYS = (
    "password",
    "passwd",
    "secret",
    "api_key",
    "apikey",
    "private_key",
    "access_token",
    "refresh_token",
    "auth_token",
    "ssn",
    "cvv",
    "cvc",
    "card_number",
    "credit_card",
)


#: Names remembered with their words and verdicts: a task's few argument names come back with every publish (two
#: regular expressions per name and per entry cost about 170 us an argument, most of a replay's own time).
NAMES_REMEMBERED = 4096


@functools.lru_cache(maxsize=NAMES_REMEMBERED)
def words(name: str) -> tuple[str, ...]:
    """A name's words: lower case, split at underscores, hyphens, dots, spaces and camelCase humps."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return tuple(word for word in re.split(r"[_\-.\s]+", spaced.lower()) if word)


def matches(name: str, entries: tuple[str, ...]) -> str | None:
    """The first entry of ``entries`` whose words appear in ``name``'s, in a row; None when none does."""
    return _matches(name, tuple(entries))


@functools.lru_cache(maxsize=NAMES_REMEMBERED)
def _matches(name: str, entries: tuple[str, ...]) -> str | None:
    found = words(name)
    for entry in entries:
        wanted = words(entry)
        for start in range(len(found) - len(wanted) + 1):
            if found[start : start + len(wanted)] == wanted:
                return entry
    return None


#: Task options whose str.format template makes a key that is stored in clear (key tables, the dead letter's
#: idempotency_key, slot holders, the admin): a field that names a secret would put the secret there.
KEY_TEMPLATES = ("idempotency_key", "concurrency_key", "exclusive_key", "ordering_key")


def template_fields(template: str) -> list[str]:
    """Every field a str.format template names, with the nested ones of its format specs (``{n:{width}}``)."""
    found = []
    for _, field, spec, _ in Formatter().parse(template):
        if field is not None:
            found.append(field)
        if spec:
            found += template_fields(spec)
    return found


def field_parts(field: str) -> list[str]:
    """The names a template field reads: ``order.api_token`` -> order, api_token; ``creds[secret]`` -> creds,
    secret (str.format's own grammar: attributes after dots, keys between brackets)."""
    return [part for part in re.split(r"[.\[\]]+", field) if part]


@task_check
def check_key_templates(task: Any) -> None:
    """Refuse a key template (:data:`KEY_TEMPLATES`, set on the task) one of whose fields, or any part of one
    (``{order.api_token}``, ``{creds[secret]}``), is matched by the task's ``redact_keys`` (a fragment
    anywhere in the name) or ``sensitive_keys`` (its words): ConfigurationError naming task, option and field.

    A callable key cannot be read: it must not return a secret (see the README). A per-call key is a value, not
    a template: not checked here."""
    templates = {name: task_attribute(task, name) for name in KEY_TEMPLATES}
    templates = {name: value for name, value in templates.items() if isinstance(value, str)}
    if not templates:
        return
    redact = [fragment.lower() for fragment in resolve(task, "redact_keys", {})]
    sensitive = tuple(resolve(task, "sensitive_keys", {}))
    for option, template in templates.items():
        try:
            fields = template_fields(template)
        except ValueError:
            continue  # a template str.format cannot parse: refused as a bad key at its first publish
        for field in fields:
            for part in field_parts(field):
                fragment = next((f for f in redact if f in part.lower()), None)
                entry = None if fragment else matches(part, sensitive)
                if fragment or entry:
                    why = f"redact_keys entry {fragment!r}" if fragment else f"sensitive_keys entry {entry!r}"
                    raise ConfigurationError(
                        option,
                        f"on task {task.name!r}: field {{{field}}} names {part!r}, a secret ({why}); the key would "
                        "keep it in clear in the key tables and the dead letter. Make the key from an id instead "
                        "(or a digest the task computes, with a callable key)",
                    )
