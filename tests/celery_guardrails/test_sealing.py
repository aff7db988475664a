"""Sealed copies: sealing, opening, rotation, the seal_keys option, and putting redacted values back."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.fernet import Fernet

from celery_guardrails.exceptions import ConfigurationError, SealError
from celery_guardrails.options import validate
from celery_guardrails.redaction import REDACTED
from celery_guardrails.sealing import SEAL_LIMIT, Sealer, restore_redacted

MESSAGE: dict[str, Any] = {
    "args": ["acct-1"],
    "kwargs": {"api_token": "tok-live-1", "options": {"region": "eu"}},
    "header": {"tenant": "acme", "cid": "req-1"},
}


def key() -> str:
    return Fernet.generate_key().decode()


def test_a_sealed_copy_opens_to_the_original_and_does_not_show_it() -> None:
    # Given a sealer with one key
    sealer = Sealer(keys=[key()])
    # When a message is sealed
    token = sealer.seal(**MESSAGE)
    # Then the token holds nothing readable, and opens to the original
    assert token is not None and "tok-live-1" not in token and "acct-1" not in token
    assert sealer.open(token) == MESSAGE


def test_rotation_new_key_first_reseal_then_drop_the_old_key() -> None:
    old, new = key(), key()
    token = Sealer(keys=[old]).seal(**MESSAGE)
    assert token is not None
    # Given the new key put first, the old one still listed: the old copy opens
    both = Sealer(keys=[new, old])
    assert both.open(token) == MESSAGE
    # When it is sealed again
    resealed = both.reseal(token)
    # Then only the new key is needed
    assert Sealer(keys=[new]).open(resealed) == MESSAGE
    # And a copy whose key was dropped does not open: a clear error, never the content
    with pytest.raises(SealError, match="none of the configured seal_keys opens this sealed copy"):
        Sealer(keys=[new]).open(token)
    with pytest.raises(SealError, match="none of the configured seal_keys"):
        Sealer(keys=[key()]).reseal(token)


def test_what_cannot_be_sealed_is_not_sealed() -> None:
    sealer = Sealer(keys=[key()])
    # arguments that are not JSON, or bigger than the limit
    assert sealer.seal(args=[object()], kwargs={}, header={}) is None
    assert sealer.seal(args=["x" * SEAL_LIMIT], kwargs={}, header={}) is None
    assert sealer.seal(args=[float("nan")], kwargs={}, header={}) is None
    # and without keys there is no sealer at all
    with pytest.raises(SealError, match="no seal_keys are configured"):
        Sealer(keys=[])


def test_a_tampered_or_foreign_token_is_a_seal_error() -> None:
    sealer = Sealer(keys=[key()])
    token = sealer.seal(**MESSAGE)
    assert token is not None
    for bad in (token[:-4] + "AAAA", "not-a-token", ""):
        with pytest.raises(SealError):
            sealer.open(bad)
    # a valid token whose content is not JSON
    secret = key()
    with pytest.raises(SealError):
        Sealer(keys=[secret]).open(Fernet(secret.encode()).encrypt(b"\xff not json").decode())


def test_a_valid_token_of_another_document_version_is_refused() -> None:
    secret = key()
    token = Fernet(secret.encode()).encrypt(b'{"v": 99, "args": []}').decode()
    with pytest.raises(SealError, match="not a document this release can read"):
        Sealer(keys=[secret]).open(token)


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
