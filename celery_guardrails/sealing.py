"""Sealed copies: what a dead letter held before redaction, encrypted, kept only to replay it.

A dead letter shows its arguments and header with secrets replaced (:mod:`celery_guardrails.redaction`); a
record whose ``api_token`` was redacted could not be replayed from what it shows. With ``seal_keys`` set, each
record also keeps a *sealed copy*: the original arguments and header as JSON, encrypted with Fernet
(AES-128-CBC and HMAC-SHA256, from the ``cryptography`` package). Nobody reads it but a replay; it is deleted
with its record.

Keys come from settings (``CELERY_GUARDRAILS["seal_keys"]``, typically read from the environment), never from
the database that holds the copies. The first key seals, every key listed opens: to rotate, put a new key
first, run ``manage.py guardrails_deadletters reseal`` (every copy sealed again with the new key), then drop
the old one. Without keys nothing is sealed, and a record with redacted arguments cannot be replayed.

Only arguments that travel as JSON are sealed (what a replay can publish again); bigger ones than
:data:`SEAL_LIMIT` are not sealed either.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery_guardrails.exceptions import SealError
from celery_guardrails.options import app_value

logger = logging.getLogger(__name__)

#: Bytes of JSON a sealed copy may hold (1 MiB): a bigger message is recorded unsealed.
SEAL_LIMIT = 1024 * 1024
#: Version of the sealed JSON document.
VERSION = 1
_UNOPENED = "none of the configured seal_keys opens this sealed copy (was its key dropped?)"


class Sealer:
    """Seals and opens copies with a list of Fernet keys (the first seals, every one opens)."""

    def __init__(self, *, keys: Sequence[str]) -> None:
        if not keys:
            raise SealError("no seal_keys are configured: sealed copies can be neither made nor opened")
        try:
            from cryptography.fernet import Fernet, MultiFernet
        except ImportError:  # pragma: no cover - the django and seal extras bring it
            raise SealError("sealing needs the cryptography package: pip install 'celery-guardrails[seal]'") from None
        self._fernet = MultiFernet([Fernet(key.encode()) for key in keys])

    def seal(self, *, args: Sequence[Any], kwargs: Mapping[str, Any], header: Mapping[str, Any]) -> str | None:
        """The sealed copy of a message, or None when it cannot be kept (not JSON, or over the limit)."""
        try:
            document = json.dumps(
                {"v": VERSION, "args": list(args), "kwargs": dict(kwargs), "header": dict(header)},
                allow_nan=False,
            ).encode()
        except (TypeError, ValueError):
            return None  # the record says its arguments were not stored as JSON; a replay refuses it anyway
        if len(document) > SEAL_LIMIT:
            return None
        return self._fernet.encrypt(document).decode()

    def open(self, token: str) -> dict[str, Any]:
        """The sealed document (``args``, ``kwargs``, ``header``); SealError when no key opens it."""
        from cryptography.fernet import InvalidToken

        try:
            document = json.loads(self._fernet.decrypt(token.encode()))
        except (InvalidToken, ValueError):
            raise SealError(_UNOPENED) from None
        if not isinstance(document, dict) or document.get("v") != VERSION:
            raise SealError("the sealed copy is not a document this release can read")
        return {
            "args": list(document.get("args") or []),
            "kwargs": dict(document.get("kwargs") or {}),
            "header": dict(document.get("header") or {}),
        }

    def reseal(self, token: str) -> str:
        """``token`` sealed again with the first key (SealError when no key opens it)."""
        from cryptography.fernet import InvalidToken

        try:
            return self._fernet.rotate(token.encode()).decode()
        except InvalidToken:
            raise SealError(_UNOPENED) from None


def sealer_for(app: Any) -> Sealer | None:
    """The app's sealer (made once per key list), or None when no ``seal_keys`` are set."""
    keys = tuple(app_value(app, "seal_keys") or ())
    if not keys:
        return None
    cached = getattr(app, "_guardrails_sealer", None)
    if cached is not None and cached[0] == keys:
        return cached[1]  # type: ignore[no-any-return]
    sealer = Sealer(keys=keys)
    app._guardrails_sealer = (keys, sealer)
    return sealer


def restore_redacted(edited: Any, original: Any, placeholder: str) -> Any:
    """``edited`` with every value still equal to ``placeholder`` taken from ``original`` at the same place.

    An operator fixing a dead letter edits what the admin shows, redacted: the secrets they could not see come
    back from the sealed copy, the values they changed stay as they wrote them. A placeholder with nothing at
    its place in the original stays (the replay then refuses it)."""
    if isinstance(edited, str) and edited == placeholder:
        return original if original is not None else edited
    if isinstance(edited, dict):
        source = original if isinstance(original, dict) else {}
        return {key: restore_redacted(value, source.get(key), placeholder) for key, value in edited.items()}
    if isinstance(edited, list):
        items = original if isinstance(original, list) else []
        return [
            restore_redacted(value, items[index] if index < len(items) else None, placeholder)
            for index, value in enumerate(edited)
        ]
    return edited
