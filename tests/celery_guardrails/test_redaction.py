"""Redaction of free text: what an error message or a traceback may say about a secret."""

from __future__ import annotations

import pytest

from celery_guardrails.redaction import redact_text


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("password=hunter2&user=ada", "password=[redacted]&user=ada"),
        ("db_password: 's3cr3t' on host x", "db_password: [redacted] on host x"),
        ('{"api_key": "k-9", "id": 7}', '{"api_key": [redacted], "id": 7}'),
        ("Authorization: Bearer eyJhbGciOi.xyz", "Authorization: [redacted] [redacted]"),
        ("sent Basic dXNlcjpwYXNz to the proxy", "sent Basic [redacted] to the proxy"),
        ("card 4111 1111 1111 1111 declined", "card [redacted] declined"),
        ("card 4111-1111-1111-1111", "card [redacted]"),
        # digits that fail the Luhn check, or are too short, are not card numbers: kept
        ("order 12345678901234 not found", "order 12345678901234 not found"),
        ("timeout after 30000 ms", "timeout after 30000 ms"),
        ("", ""),
    ],
)
def test_secrets_in_text_are_redacted_and_the_rest_kept(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


def test_the_tasks_own_keys_are_used() -> None:
    assert redact_text("pin=1234 name=ada", keys=("pin",)) == "pin=[redacted] name=ada"
    assert redact_text("pin=1234 password=x", keys=()) == "pin=1234 password=x"
