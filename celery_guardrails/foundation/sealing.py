"""Sealed copies: what a dead letter held before redaction, encrypted, kept only to replay it.

A dead letter shows its arguments and header with secrets replaced (:mod:`celery_guardrails.foundation.redaction`); a
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

A sealed copy is bound to its record. The document (version 2) carries the identity of the record it was sealed
for (:class:`Binding`: task id, task name, tenant), and :meth:`Sealer.open` is given the record it is opened
for: a copy moved onto another record (one database write: record 3's token copied onto record 5 of another
tenant) is refused with :class:`~celery_guardrails.exceptions.SealError` "the sealed copy belongs to another
record", and nothing is replayed. The identity is compared as the record stores it (NUL and lone surrogates
escaped, cut to the record's column widths), so a record whose ids were escaped or cut still opens its own copy.

Upgrade: copies sealed before (document version 1) hold no identity. They still open, but only for a record
they match: the record's tenant is the tenant in the copy's header, and the correlation id and publish time
(``cid``, ``pub``) in the copy's header are those of the record's stored header (a message's publish time is
its own, to the millisecond). A version 1 copy moved onto another record is refused like a version 2 one, but
where two records share tenant, correlation id and publish time (a group published in one millisecond, or
messages of plain Celery publishers, which carry no header) it cannot tell them apart. ``reseal`` keeps a
copy's document as it is (it changes the key only); version 1 copies go with their records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from celery_guardrails.exceptions import SealError
from celery_guardrails.options import APP, Option, app_value, checks, declare

logger = logging.getLogger(__name__)

#: Bytes of JSON a sealed copy may hold (1 MiB): a bigger message is recorded unsealed.
SEAL_LIMIT = 1024 * 1024
#: Version of the sealed JSON document: 2 carries the identity of its record (``for``); 1 (earlier releases) not.
VERSION = 2
#: Document versions this release opens.
READABLE = (1, 2)
_UNOPENED = "none of the configured seal_keys opens this sealed copy (was its key dropped?)"
_ELSEWHERE = "the sealed copy belongs to another record"
#: Characters of each identity field a record keeps: the widths of the Django sink's columns (DeadLetter),
#: where a longer value is cut; a copy is bound to the value as stored.
IDENTITY_WIDTHS = {"task_id": 255, "task_name": 200, "tenant": 128}


def _fernet_keys(value: Any) -> tuple[str, ...]:
    import base64
    import binascii

    # Never echo a key, nor any part of a value that may hold one: messages name the place only.
    keys = [value] if isinstance(value, str | bytes) else value
    if not isinstance(keys, list | tuple):  # a set has no first key to seal with; a dict is not a list
        raise ValueError(
            f"must be a list of Fernet keys (the first seals, every one opens), got {checks.kind(value)} (not shown)"
        )
    checked = []
    for number, key in enumerate(keys, start=1):
        try:  # bytes, as Fernet.generate_key() returns them, are the same key: kept as text
            text = key.decode("ascii") if isinstance(key, bytes) else key
            valid = isinstance(text, str) and len(base64.urlsafe_b64decode(text.encode("ascii"))) == 32
        except (binascii.Error, ValueError):
            valid = False
        if not valid:
            raise ValueError(
                f"key {number} is not a Fernet key (32 url-safe base64-encoded bytes; make one with "
                "cryptography.fernet.Fernet.generate_key()); the key is not shown"
            )
        checked.append(text)
    return tuple(checked)


#: The options sealing reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="seal_keys",
        default=(),
        doc="Fernet keys that seal the original arguments and header of each dead letter for replay (the "
        "record itself shows them redacted). The first seals, every one opens: to rotate, put a new key first, "
        "run `manage.py guardrails_deadletters reseal`, then drop the old one. Empty: no sealed copies, and a "
        "record with redacted arguments cannot be replayed. Needs the cryptography package.",
        check=_fernet_keys,
        scopes=frozenset({APP}),
    ),
)


class Identified(Protocol):
    """What a sealed copy is bound to: a dead letter record, or the final failure it is recorded from."""

    @property
    def task_id(self) -> str: ...

    @property
    def task_name(self) -> str: ...

    @property
    def tenant(self) -> str | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Binding:
    """The identity of the record a sealed copy belongs to, as the record stores it."""

    task_id: str
    task_name: str
    tenant: str  # "" without a tenant

    @classmethod
    def of(cls, record: Identified) -> Binding:
        values = {name: _stored(getattr(record, name) or "", width) for name, width in IDENTITY_WIDTHS.items()}
        return cls(**values)


def _stored(value: object, width: int) -> str:
    """``value`` as a record column keeps it: text, NUL and lone surrogates escaped (dead_letters.storable),
    cut to ``width``. Applied to what is already stored, it changes nothing."""
    text = str(value).replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode()
    return text[:width]


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

    def seal(
        self, *, args: Sequence[Any], kwargs: Mapping[str, Any], header: Mapping[str, Any], record: Identified
    ) -> str | None:
        """The sealed copy of a message, bound to ``record`` (the failure it is recorded from), or None when it
        cannot be kept (not JSON, or over the limit)."""
        try:
            document = json.dumps(
                {
                    "v": VERSION,
                    "for": asdict(Binding.of(record)),
                    "args": list(args),
                    "kwargs": dict(kwargs),
                    "header": dict(header),
                },
                allow_nan=False,
            ).encode()
        except (TypeError, ValueError):
            return None  # the record says its arguments were not stored as JSON; a replay refuses it anyway
        if len(document) > SEAL_LIMIT:
            return None
        return self._fernet.encrypt(document).decode()

    def open(self, token: str, *, record: Any) -> dict[str, Any]:
        """The sealed document (``args``, ``kwargs``, ``header``) of ``record`` (a dead letter: its task_id,
        task_name, tenant and, for a version 1 copy, its stored ``header``); SealError when no key opens it, or
        when it was sealed for another record."""
        from cryptography.fernet import InvalidToken

        try:
            document = json.loads(self._fernet.decrypt(token.encode()))
        except (InvalidToken, ValueError):
            raise SealError(_UNOPENED) from None
        if not isinstance(document, dict) or document.get("v") not in READABLE:
            raise SealError("the sealed copy is not a document this release can read")
        header = document.get("header") or {}
        if not isinstance(header, dict):
            raise SealError("the sealed copy is not a document this release can read")
        if not _belongs(document, header, record):
            raise SealError(_ELSEWHERE)
        return {
            "args": list(document.get("args") or []),
            "kwargs": dict(document.get("kwargs") or {}),
            "header": dict(header),
        }

    def reseal(self, token: str) -> str:
        """``token`` sealed again with the first key (SealError when no key opens it)."""
        from cryptography.fernet import InvalidToken

        try:
            return self._fernet.rotate(token.encode()).decode()
        except InvalidToken:
            raise SealError(_UNOPENED) from None


def _belongs(document: dict[str, Any], header: dict[str, Any], record: Any) -> bool:
    """Whether the opened ``document`` was sealed for ``record`` (see the module docstring)."""
    mine = Binding.of(record)
    if document.get("v") != 1:
        sealed = document.get("for")
        return isinstance(sealed, dict) and sealed == asdict(mine)
    # Version 1: no identity inside; what its header holds must be the record's own.
    stored = getattr(record, "header", None)
    stored = stored if isinstance(stored, dict) else {}
    tenant = _stored(header.get("tenant") or "", IDENTITY_WIDTHS["tenant"])
    return tenant == mine.tenant and all(header.get(name) == stored.get(name) for name in ("cid", "pub"))


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
