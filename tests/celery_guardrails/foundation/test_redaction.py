"""Redaction: by name and by value, in free text and in arguments, bounded on any input."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.foundation.redaction import (
    CUT_DEEP,
    MAX_DEPTH,
    REDACTED,
    VALUE_PATTERNS,
    redact,
    redact_arguments,
    redact_text,
)
from celery_guardrails.foundation.sealing import restore_redacted
from celery_guardrails.options import validate, validate_task
from tests.support import planted
from tests.support.planted import leaked


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("password=hunter2&user=ada", "password=[redacted]&user=ada"),
        ("login refused: password=hunter2 again", "login refused: password=[redacted] again"),
        ("a=b=password=hunter2", "a=b=password=[redacted]"),
        ("db_password: 's3cr3t' on host x", "db_password: [redacted] on host x"),
        ('{"api_key": "k-9", "id": 7}', '{"api_key": [redacted], "id": 7}'),
        ("Authorization: Bearer eyJhbGciOi.xyz", "Authorization: [redacted] [redacted]"),
        ("sent Basic dXNlcjpwYXNz to the proxy", "sent Basic [redacted] to the proxy"),
        ("card 4111 1111 1111 1111 declined", "card [redacted] declined"),
        ("card 4111-1111-1111-1111", "card [redacted]"),
        # digits that fail the Luhn check, or are too short, are not card numbers: kept
        ("order 12345678901234 not found", "order 12345678901234 not found"),
        ("timeout after 30000 ms", "timeout after 30000 ms"),
        # a task id whose digits pass the Luhn check (625-0996254939) is an id, not a card number: kept whole
        ("Task t[d0b15bb7-ef0b-4d3c-a625-0996254939a4] failed", "Task t[d0b15bb7-ef0b-4d3c-a625-0996254939a4] failed"),
        ("", ""),
    ],
)
def test_secrets_in_text_are_redacted_and_the_rest_kept(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


def test_the_tasks_own_keys_are_used() -> None:
    assert redact_text("pin=1234 name=ada", keys=("pin",)) == "pin=[redacted] name=ada"
    assert redact_text("pin=1234 password=x", keys=()) == "pin=1234 password=x"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        # URL credentials: the password goes, the user, host and path stay (also a password holding "@")
        (
            "could not connect to postgresql://app:Sup3rS3cret@db/shop: timeout",
            "could not connect to postgresql://app:[redacted]@db/shop: timeout",
        ),
        ("redis://:pa@ss@cache:6379/0 refused", "redis://:[redacted]@cache:6379/0 refused"),
        ("amqp://user:pass1@mq:5672// down", "amqp://user:[redacted]@mq:5672// down"),
        ("GET https://user:hunter2@api.example.com/x", "GET https://user:[redacted]@api.example.com/x"),
        ("see https://example.com/a:b and mail me@example.com", "see https://example.com/a:b and mail me@example.com"),
        # well-known key shapes, bare in a message
        ("invalid key sk_live_4eC39HqLyjWDarjtT1zdp7dc", "invalid key [redacted]"),
        ("rk_live_51H8abcdEFGHijkl and whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "[redacted] and [redacted]"),
        ("aws AKIAIOSFODNN7EXAMPLE / wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY ok", "aws [redacted] / [redacted] ok"),
        ("session ASIAY34FZKBOKMUTVV7A expired", "session [redacted] expired"),
        ("token ghp_16C7e42F292c6912E7710c838347Ae178B4a refused", "token [redacted] refused"),
        ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123", "[redacted]"),
        ("slack xoxb-2048-1337-AbCdEfGhIjKlMnOp said no", "slack [redacted] said no"),
        ("maps AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe quota", "maps [redacted] quota"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl bad", "jwt [redacted] bad"),
        (
            "key -----BEGIN PRIVATE KEY-----\nMIIEvQ+/=\nAbC\n-----END PRIVATE KEY----- unreadable",
            "key [redacted] unreadable",
        ),
        ("cut -----BEGIN EC PRIVATE KEY-----\nMHcCAQEE\nIIXy", "cut [redacted]"),  # no END line: to its end
        # a header given as a list pair, as its repr shows it
        (
            "headers [('X-Api-Key', 'abc123'), ('Accept', 'json')]",
            "headers [('X-Api-Key', [redacted]), ('Accept', 'json')]",
        ),
        ('["authorization", "Token 99"]', '["authorization", [redacted]]'),
        # English after Bearer/Basic/Token is not a credential
        ("a basic example; the token expired", "a basic example; the token expired"),
    ],
)
def test_secrets_are_found_by_their_value(text: str, redacted: str) -> None:
    assert redact_text(text) == redacted


def test_each_built_in_pattern_redacts_its_documented_example() -> None:
    # Given the documented list: a name and an example each (the module docstring's table)
    names = [pattern.name for pattern in VALUE_PATTERNS]
    assert names == [
        "url_credentials",
        "bearer_credentials",
        "stripe_key",
        "aws_access_key",
        "github_token",
        "slack_token",
        "google_api_key",
        "jwt",
        "private_key",
        "card_number",
    ]
    for pattern in VALUE_PATTERNS:
        # Then each example loses its secret part, and the pattern alone finds it
        assert pattern.example and list(pattern.spans(pattern.example)), pattern.name
        assert redact_text(pattern.example) != pattern.example, pattern.name


def test_every_planted_secret_leaves_a_message_and_the_rest_stays() -> None:
    redacted = redact_text(planted.MESSAGE)
    assert leaked(redacted) == []
    assert redact_text(redacted) == redacted  # a line that quotes a redacted message is redacted the same
    assert redacted.startswith("could not connect to postgresql://app:[redacted]@db/shop (cache redis://:[redacted]@")


def test_an_argument_with_a_secret_is_replaced_whole_and_a_replay_restores_it() -> None:
    # Given a call whose secrets sit under names that are not sensitive, and a header given as pairs
    def sync(dsn: str, headers: list[Any], note: str = "", **rest: Any) -> None: ...

    args = ["postgresql://app:pw1@db/x", [["authorization", "Bearer abc123"], ("X-Api-Key", "k1"), ["accept", "json"]]]
    kwargs = {"note": "sk_live_4eC39HqLyjWDarjtT1zdp7dc", "city": "Paris", **planted.ARGUMENTS}
    # When they are redacted for the record
    clean = redact_arguments(sync, args, kwargs)
    # Then every value holding a secret is exactly the placeholder (never part of it), the rest is kept
    assert clean.args == [
        REDACTED,
        [["authorization", REDACTED], ["X-Api-Key", REDACTED], ["accept", "json"]],
    ]
    assert (clean.kwargs["note"], clean.kwargs["city"], clean.as_repr, clean.cut) == (REDACTED, "Paris", False, False)
    assert leaked(clean.kwargs) == [] and leaked(clean.args) == []
    # And an edit-and-replay puts every one of them back from the sealed copy
    original = json.loads(json.dumps([args, kwargs]))
    assert restore_redacted([clean.args, clean.kwargs], original, REDACTED) == original


def test_redact_patterns_add_to_the_built_in_ones() -> None:
    # Given the option's patterns: one whole, one with a secret group
    patterns = validate({"redact_patterns": [r"ACME-[0-9]{6}", r"pin (?P<secret>\d{4})"]})["redact_patterns"]
    # Then free text loses the match (only the group, when there is one), built-ins still apply
    text = "order ACME-123456 pin 1234, key sk_live_4eC39HqLyjWDarjtT1zdp7dc"
    assert redact_text(text, patterns=patterns) == "order [redacted] pin [redacted], key [redacted]"
    # And an argument holding a match is replaced whole
    assert redact({"ref": "ACME-123456", "pin": "pin 1234", "n": "ACME-12"}, patterns=patterns) == {
        "ref": REDACTED,
        "pin": REDACTED,
        "n": "ACME-12",
    }


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("(", "pattern 1 is not a regular expression"),
        (["ok", "x*"], "pattern 2 matches the empty string"),
        ([b"bytes"], "pattern 1 is a bytes pattern"),
        (42, "must be a list of regular expressions"),
    ],
)
def test_a_bad_redact_pattern_stops_the_start_naming_the_key(value: Any, problem: str) -> None:
    with pytest.raises(ConfigurationError, match="redact_patterns") as raised:
        validate({"redact_patterns": value})
    assert problem in str(raised.value)


def test_redact_patterns_and_redact_results_may_be_set_on_a_task() -> None:
    class Task:
        name = "t"
        redact_patterns = ["("]

    with pytest.raises(ConfigurationError, match=r"redact_patterns.*on task 't'"):
        validate_task(Task())
    with pytest.raises(ConfigurationError, match="redact_results"):
        validate({"redact_results": "yes"})


#: A megabyte of each pattern's near-miss: text that starts like a secret again and again and is none (the
#: ones that cost the most of those tried).
NEAR_MISSES = {
    "url_credentials": "a://b:" * 170_000,
    "bearer_credentials": "Bearer " * 150_000,
    "stripe_key": "whsec_abc " * 100_000,
    "aws_access_key": ("AKIAIOSFODNN7EXAMPLE" + "a" * 39) * 17_000,
    "github_token": "ghp_" * 250_000,
    "slack_token": "xox-" * 250_000,
    "google_api_key": "AIza-" * 200_000,
    "jwt": "eyJ" + "a" * 500_000 + ".eyJ" + "b" * 500_000,
    "private_key": "-----BEGIN RSA PRIVATE KEY----- x -----END DSA PUBLIC KEY----- " * 15_000,
    "card_number": "4111 " * 200_000,
    "key_pairs": "password" * 125_000,
    "key_pairs_chained": "a=" * 500_000,
    "key_pairs_unquoted": 'password="' + "password=x" * 100_000,
    "list_pairs": "[('password', '" * 66_000,
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_a_megabyte_of_near_misses_is_redacted_in_linear_time(name: str) -> None:
    # (No timing is asserted: a pattern that is not linear on these takes minutes, and the run's timeout ends it.)
    assert isinstance(redact_text(NEAR_MISSES[name]), str)


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError(planted.STRIPE_KEY)

    __str__ = __repr__


class Chatty:
    def __repr__(self) -> str:
        return f"Chatty(dsn={planted.PG_URL!r})"


def _deep(levels: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def hostile_values() -> dict[str, Any]:
    cycle: list[Any] = []
    cycle.append(cycle)
    return {
        "nested 5,000 deep": _deep(5_000, planted.STRIPE_KEY),
        "dict nested 5,000 deep": {"a": _deep(5_000, {"k": planted.JWT})},
        "a list of 25,000 (past MAX_VALUES)": [planted.GITHUB_TOKEN] * 25_000,
        "a dict of 25,000": {f"k{i}": planted.SLACK_TOKEN for i in range(25_000)},
        "a string of 5 MB": "x " * 2_500_000 + planted.GOOGLE_KEY,
        "bytes": planted.MESSAGE.encode(),
        "a set": {planted.STRIPE_KEY, planted.PG_URL},
        "repr raises": Unprintable(),
        "repr says it": Chatty(),
        "keys that are not strings": {(1, planted.AWS_KEY_ID): 1, None: 2, 1.5: 3, Unprintable(): 4},
        "a key that is a secret": {planted.STRIPE_KEY: 1, planted.GITHUB_TOKEN: 2},
        "lone surrogates and NUL": f"\ud800 {planted.JWT} \x00 \udfff",
        "NaN and infinity": [math.nan, math.inf, -math.inf],
        "a huge int": 10**20_000,
        "a cycle": cycle,
        "a mapping that raises": BrokenMapping(),
    }


class BrokenMapping(dict[str, Any]):
    def items(self) -> Any:
        raise RuntimeError(planted.AWS_SECRET)


@pytest.mark.parametrize("name", sorted(hostile_values()))
def test_hostile_values_never_raise_and_leave_json_without_secrets(name: str) -> None:
    value = hostile_values()[name]

    def task(payload: Any, *args: Any, **kwargs: Any) -> None: ...

    # When hostile values go through every walk and the text redaction
    clean = redact_arguments(task, [value, value], {"k": value, "pair": ["token", value]})
    kept = redact(value)
    text = redact_text(value)  # not text: its repr, bounded
    # Then each result is JSON as strict as PostgreSQL's, and no planted secret is left in it
    for result in (clean.args, clean.kwargs, kept, text):
        encoded = json.dumps(result, allow_nan=False)
        assert leaked(encoded) == [], name


def test_a_value_past_the_depth_limit_is_cut_and_the_result_says_so() -> None:
    deep = _deep(MAX_DEPTH + 10, "leaf")
    clean = redact_arguments(lambda payload: None, [deep], {})
    assert clean.cut is True and clean.as_repr is False
    assert tuple(clean)[2] is True  # unpacked, as a record's arguments_are_repr: not kept whole
    innermost = clean.args[0]
    for _ in range(MAX_DEPTH):
        (innermost,) = innermost
    assert innermost == CUT_DEEP and REDACTED in CUT_DEEP  # a replay without a sealed copy refuses it
    shallow = redact_arguments(lambda payload: None, [_deep(MAX_DEPTH - 1, "leaf")], {})
    assert shallow.cut is False and "leaf" in json.dumps(shallow.args)


def test_arguments_still_unpack_as_before() -> None:
    args, kwargs, as_repr = redact_arguments(lambda x: None, [1], {"y": 2})
    assert (args, kwargs, as_repr) == ([1], {"y": 2}, False)


def test_a_key_fragment_matches_however_a_header_spells_it() -> None:
    assert redact({"X-Api-Key": "a", "api key": "b", "APIKEY": "c", "X-Auth-Token": "d", "id": 1}) == {
        "X-Api-Key": REDACTED,
        "api key": REDACTED,
        "APIKEY": REDACTED,
        "X-Auth-Token": REDACTED,
        "id": 1,
    }
