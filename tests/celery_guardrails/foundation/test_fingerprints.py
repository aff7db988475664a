"""Fingerprints: what varies between occurrences of one cause is left out; what tells causes apart is kept."""

from __future__ import annotations

import pytest

from celery_guardrails.foundation.fingerprints import LENGTH, MESSAGE_CHARS, fingerprint, normalised, own_frame


def traceback(*frames: tuple[str, int, str]) -> str:
    lines = ["Traceback (most recent call last):"]
    for path, line, function in frames:
        lines += [f'  File "{path}", line {line}, in {function}', "    something()"]
    return "\n".join([*lines, "shop.Declined: no"])


CELERY = ("/srv/app/.venv/lib/python3.11/site-packages/celery/app/trace.py", 453, "trace_task")
STDLIB = ("/usr/lib/python3.11/json/decoder.py", 337, "decode")


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("order 42 declined (code 5001)", "order <n> declined (code <n>)"),
        ("card '4242' expired", "card '<q>' expired"),
        ('no row "acme-7"', 'no row "<q>"'),
        ("job 123e4567-e89b-12d3-a456-426614174000 missing", "job <uuid> missing"),
        ("request 3f2a9c1e4b7d8a90 failed", "request <hex> failed"),
        ("mail to ada@example.com bounced", "mail to <email> bounced"),
        ("timeout after 30.5s,  retrying\n", "timeout after <n>s, retrying"),
        ("HTTP 503 from https://api.example.com/v2/charges", "HTTP <n> from https://api.example.com/v2/charges"),
        ("order-77 and x-1", "order-<n> and x-<n>"),
        ("deadbeef is a word; so is cafe", "deadbeef is a word; so is cafe"),
        ("", ""),
    ],
)
def test_a_message_is_normalised_to_what_every_occurrence_shares(message: str, expected: str) -> None:
    assert normalised(message) == expected


def test_the_frame_is_the_innermost_in_the_task_module_else_the_innermost_of_the_project() -> None:
    # Given a failure that went from Celery through the task's module into a helper of the project and the
    # standard library
    frames = traceback(
        CELERY,
        ("/srv/releases/20261207/shop/tasks.py", 42, "charge_order"),
        ("/srv/releases/20261207/shop/tasks.py", 60, "_charge"),
        ("/srv/releases/20261207/shop/provider.py", 10, "charge"),
        STDLIB,
    )
    # Then the task's own frame is the innermost one in its module, written from its top package
    assert own_frame("shop.tasks.charge_order", frames) == "shop/tasks.py:_charge"
    # And a task elsewhere gets the innermost frame outside installed packages and the standard library
    assert own_frame("billing.jobs.run", frames) == "shop/provider.py:charge"  # its last two path parts
    # And a traceback with none of the project's code, or none at all, gives none
    assert own_frame("shop.tasks.charge_order", traceback(CELERY, STDLIB)) == ""
    assert own_frame("shop.tasks.charge_order", "") == ""


def test_occurrences_of_one_cause_share_a_fingerprint_whatever_their_ids_lines_and_release() -> None:
    base = {
        "task_name": "shop.tasks.charge_order",
        "exc_type": "shop.Declined",
        "exc_message": "order 42 declined by 'acct-42'",
        "traceback": traceback(CELERY, ("/srv/releases/1/shop/tasks.py", 42, "charge_order")),
    }
    same = [
        {**base, "exc_message": "order 977 declined by 'acct-977'"},
        {**base, "traceback": traceback(CELERY, ("/srv/releases/2/shop/tasks.py", 57, "charge_order"))},
        {**base, "traceback": traceback(CELERY, ("C:\\app\\shop\\tasks.py", 42, "charge_order"))},
    ]
    different = [
        {**base, "task_name": "shop.tasks.refund_order"},
        {**base, "exc_type": "shop.Expired"},
        {**base, "exc_message": "order 42 expired"},
        {**base, "traceback": traceback(CELERY, ("/srv/releases/1/shop/tasks.py", 42, "refund_order"))},
    ]
    first = fingerprint(**base)
    assert len(first) == LENGTH and int(first, 16) >= 0
    assert [fingerprint(**parts) for parts in same] == [first] * len(same)
    found = [fingerprint(**parts) for parts in different]
    assert first not in found and len(set(found)) == len(different)


def test_only_the_start_of_a_long_message_is_read_and_blank_lines_are_no_frames() -> None:
    # Given a message far longer than any record keeps, and a traceback padded with empty lines
    long = "order 42 declined; " * 1_000
    # Then the message is normalised up to MESSAGE_CHARS (the rest could not tell causes apart: a record keeps 500)
    assert normalised(long) == normalised(long[:MESSAGE_CHARS])
    assert normalised(long[:MESSAGE_CHARS] + " card 'x' expired") == normalised(long)
    # And a frame is found after any number of empty lines, indented with a tab too
    padded = "\n" * 5_000 + '\tFile "/srv/shop/tasks.py", line 3, in charge_order\n' + "\n" * 5_000
    assert own_frame("shop.tasks.charge_order", padded) == "shop/tasks.py:charge_order"
