"""Sealed copies: sealing, opening, rotation, the binding to their record, the seal_keys option, and putting
redacted values back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from cryptography.fernet import Fernet

from celery_guardrails.exceptions import ConfigurationError, SealError
from celery_guardrails.foundation.redaction import REDACTED
from celery_guardrails.foundation.sealing import SEAL_LIMIT, Sealer, restore_redacted
from celery_guardrails.options import validate

MESSAGE: dict[str, Any] = {
    "args": ["acct-1"],
    "kwargs": {"api_token": "tok-live-1", "options": {"region": "eu"}},
    "header": {"tenant": "acme", "cid": "req-1", "pub": 1796000000.25},
}


@dataclass(frozen=True)
class Record:
    """What a sealed copy is bound to, as a dead letter holds it (the DeadLetter columns of the same names)."""

    task_id: str = "3f6c0b1e-0000-4000-8000-000000000003"
    task_name: str = "shop.charge"
    tenant: str = "acme"
    header: dict[str, Any] = field(default_factory=lambda: {"tenant": "acme", "cid": "req-1", "pub": 1796000000.25})


RECORD = Record()


def key() -> str:
    return Fernet.generate_key().decode()


def test_a_sealed_copy_opens_to_the_original_and_does_not_show_it() -> None:
    # Given a sealer with one key
    sealer = Sealer(keys=[key()])
    # When a message is sealed
    token = sealer.seal(**MESSAGE, record=RECORD)
    # Then the token holds nothing readable, and opens to the original
    assert token is not None and "tok-live-1" not in token and "acct-1" not in token
    assert sealer.open(token, record=RECORD) == MESSAGE


def test_rotation_new_key_first_reseal_then_drop_the_old_key() -> None:
    old, new = key(), key()
    token = Sealer(keys=[old]).seal(**MESSAGE, record=RECORD)
    assert token is not None
    # Given the new key put first, the old one still listed: the old copy opens
    both = Sealer(keys=[new, old])
    assert both.open(token, record=RECORD) == MESSAGE
    # When it is sealed again
    resealed = both.reseal(token)
    # Then only the new key is needed
    assert Sealer(keys=[new]).open(resealed, record=RECORD) == MESSAGE
    # And a copy whose key was dropped does not open: a clear error, never the content
    with pytest.raises(SealError, match="none of the configured seal_keys opens this sealed copy"):
        Sealer(keys=[new]).open(token, record=RECORD)
    with pytest.raises(SealError, match="none of the configured seal_keys"):
        Sealer(keys=[key()]).reseal(token)


def test_what_cannot_be_sealed_is_not_sealed() -> None:
    sealer = Sealer(keys=[key()])
    # arguments that are not JSON, or bigger than the limit
    assert sealer.seal(args=[object()], kwargs={}, header={}, record=RECORD) is None
    assert sealer.seal(args=["x" * SEAL_LIMIT], kwargs={}, header={}, record=RECORD) is None
    assert sealer.seal(args=[float("nan")], kwargs={}, header={}, record=RECORD) is None
    # and without keys there is no sealer at all
    with pytest.raises(SealError, match="no seal_keys are configured"):
        Sealer(keys=[])


def test_a_tampered_or_foreign_token_is_a_seal_error() -> None:
    sealer = Sealer(keys=[key()])
    token = sealer.seal(**MESSAGE, record=RECORD)
    assert token is not None
    for bad in (token[:-4] + "AAAA", "not-a-token", ""):
        with pytest.raises(SealError):
            sealer.open(bad, record=RECORD)
    # a valid token whose content is not JSON
    secret = key()
    with pytest.raises(SealError):
        Sealer(keys=[secret]).open(Fernet(secret.encode()).encrypt(b"\xff not json").decode(), record=RECORD)


def test_a_valid_token_of_another_document_version_is_refused() -> None:
    secret = key()
    token = Fernet(secret.encode()).encrypt(b'{"v": 99, "args": []}').decode()
    with pytest.raises(SealError, match="not a document this release can read"):
        Sealer(keys=[secret]).open(token, record=RECORD)


def test_seal_keys_option_checks_each_key_and_never_echoes_it() -> None:
    good = key()
    assert validate({"seal_keys": [good]}) == {"seal_keys": (good,)}
    assert validate({"seal_keys": good}) == {"seal_keys": (good,)}
    for bad in (["not-a-key-but-long-enough-to-look-secret"], [good, 42], "short", 7):
        with pytest.raises(ConfigurationError) as raised:
            validate({"seal_keys": bad})
        assert "seal_keys" in str(raised.value)
        assert "not-a-key-but-long" not in str(raised.value)
        assert good not in str(raised.value)


def pieces(secret: str) -> set[str]:
    """Every 6 characters in a row of ``secret``: an error showing any of them showed part of it."""
    return {secret[i : i + 6] for i in range(len(secret) - 5)}


def test_seal_keys_given_as_bytes_are_taken_and_as_a_set_or_a_dict_refused_without_a_character_of_them() -> None:
    # Given keys as Fernet.generate_key() returns them: bytes, alone or in a list
    first, second = key(), key()
    # Then they are the same keys, kept as text
    assert validate({"seal_keys": first.encode()}) == {"seal_keys": (first,)}
    assert validate({"seal_keys": [first.encode(), second]}) == {"seal_keys": (first, second)}
    # When they come as a set (no first key to seal with), a dict, bytes that are no key, or a bad key in bytes
    for bad in (
        {first, second},
        {"primary": first},
        {first: "primary"},
        b"\xff" + first.encode(),
        [first[:-2].encode()],
    ):
        with pytest.raises(ConfigurationError) as raised:
            validate({"seal_keys": bad})
        # Then the error names the setting, and shows no piece of any key
        message = str(raised.value)
        assert message.startswith("celery-guardrails setting 'seal_keys': ")
        assert not any(piece in message for piece in pieces(first) | pieces(second)), message


def test_a_copy_opens_only_for_the_record_it_was_sealed_for() -> None:
    # Given record 3's copy, sealed for its task id, task name and tenant
    sealer = Sealer(keys=[key()])
    token = sealer.seal(**MESSAGE, record=RECORD)
    assert token is not None
    # When it is opened for another record (another task id, another tenant, another task, or all three)
    others = [
        replace(RECORD, task_id="3f6c0b1e-0000-4000-8000-000000000005"),
        replace(RECORD, tenant="globex"),
        replace(RECORD, tenant=""),
        replace(RECORD, task_name="shop.refund"),
        Record(task_id="5", task_name="shop.refund", tenant="globex"),
    ]
    for other in others:
        # Then it is refused, saying why, and nothing of it comes out
        with pytest.raises(SealError, match=r"^the sealed copy belongs to another record$"):
            sealer.open(token, record=other)
    # And its own record still opens it
    assert sealer.open(token, record=RECORD) == MESSAGE


def test_a_copy_opens_for_its_record_as_the_record_stores_it() -> None:
    # Given a failure whose task id holds a NUL and a lone surrogate, and a task name longer than its column
    from celery_guardrails.runtime.dead_letters import storable

    failure = Record(task_id="id\x00\udc80-" + "x" * 300, task_name="t" * 250, tenant="acme")
    sealer = Sealer(keys=[key()])
    token = sealer.seal(**MESSAGE, record=failure)
    assert token is not None
    # When the record stores them as the Django sink does (escaped, cut to the column), Then it opens its copy
    stored = Record(task_id=storable(failure.task_id)[:255], task_name=failure.task_name[:200], tenant="acme")
    assert sealer.open(token, record=stored) == MESSAGE
    # And another record whose ids share the stored prefix only does not
    with pytest.raises(SealError, match="belongs to another record"):
        sealer.open(token, record=replace(stored, task_id=stored.task_id[:-1]))


def version_1(secret: str, message: dict[str, Any]) -> str:
    """A copy as the release before sealed it: document version 1, no identity inside."""
    document = {"v": 1, "args": message["args"], "kwargs": message["kwargs"], "header": message["header"]}
    return Fernet(secret.encode()).encrypt(json.dumps(document, allow_nan=False).encode()).decode()


def test_a_version_1_copy_opens_only_for_the_record_its_header_matches() -> None:
    # Given a copy sealed by the release before (no identity inside), and the record it was recorded with
    secret = key()
    token = version_1(secret, MESSAGE)
    sealer = Sealer(keys=[secret])
    # Then it still opens for its own record: tenant, correlation id and publish time are the record's own
    assert sealer.open(token, record=RECORD) == MESSAGE
    # But not for a record of another tenant, correlation id or publish time (the records it could be moved to)
    others = [
        replace(RECORD, tenant="globex", header={**RECORD.header, "tenant": "globex"}),
        replace(RECORD, tenant="globex"),
        replace(RECORD, header={**RECORD.header, "cid": "req-2"}),
        replace(RECORD, header={**RECORD.header, "pub": 1796000000.5}),
        replace(RECORD, header={}),
    ]
    for other in others:
        with pytest.raises(SealError, match="belongs to another record"):
            sealer.open(token, record=other)
    # And a key rotation keeps it a version 1 copy that opens the same way
    new = key()
    rotated = Sealer(keys=[new, secret]).reseal(token)
    assert Sealer(keys=[new]).open(rotated, record=RECORD) == MESSAGE
    with pytest.raises(SealError, match="belongs to another record"):
        Sealer(keys=[new]).open(rotated, record=others[0])


def test_restore_redacted_takes_placeholders_from_the_original_and_keeps_edits() -> None:
    original = {"api_token": "tok-1", "options": {"region": "us", "password": "pw"}, "ids": [1, "s3"]}
    edited = {"api_token": REDACTED, "options": {"region": "eu", "password": REDACTED}, "ids": [1, REDACTED]}
    # placeholders come back from the original, at the same place; edits stay
    assert restore_redacted(edited, original, REDACTED) == {
        "api_token": "tok-1",
        "options": {"region": "eu", "password": "pw"},
        "ids": [1, "s3"],
    }
    # a placeholder with nothing at its place in the original stays (the replay then refuses it)
    assert restore_redacted({"new": REDACTED}, original, REDACTED) == {"new": REDACTED}
    assert restore_redacted([REDACTED, REDACTED], ["a"], REDACTED) == ["a", REDACTED]
    # a structure the operator replaced is theirs
    assert restore_redacted({"options": "none"}, original, REDACTED) == {"options": "none"}
