"""Bad input to the admin and the management commands: a 400, a form error or a one-line CommandError, never a
500 or a traceback.

Each case is sent to the real view through Django's test client (which raises what a view raises: a 500 fails
the test), or given to the real command with ``call_command``, on PostgreSQL and on SQLite. The values are the
review's (a NUL byte in a filter, JSON nested thousands deep, ``--since 99999999999999999999d``, a ``--by`` of
500 characters) and their neighbours: numbers too large or negative, NaN, lone surrogates, a 10 MB body, wrong
types, lookups the list does not declare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin import site
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, RequestFactory
from django.urls import reverse

from django_celery_guardrails.models import DeadLetter, ScheduledRun

pytestmark = pytest.mark.django_db
DEAD_LETTERS = "/admin/guardrails/deadletter/"
LEDGER = "/admin/guardrails/scheduledrun/"
FORM = "form error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    name: str
    url: str
    data: dict[str, Any] = field(default_factory=dict)
    method: str = "get"
    #: The status code, or FORM: the page again (200) with an error on the named form field, nothing replayed.
    expect: int | str = 400
    field: str = ""


def nested(depth: int, *, key: str | None = None) -> str:
    """JSON nested ``depth`` levels deep: lists, or objects under ``key``."""
    if key is None:
        return "[" * depth + "]" * depth
    return f'{{"{key}": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def edit(name: str, field_name: str, **values: str) -> Request:
    data = {"tenant": "", "args": "[]", "kwargs": "{}", **values}
    return Request(name=name, url="{edit}", data=data, method="post", expect=FORM, field=field_name)


def action(name: str, **values: Any) -> Request:
    data = {"action": "discard_selected", "index": "0", "_selected_action": ["{pk}"], **values}
    return Request(name=name, url=DEAD_LETTERS, data=data, method="post")


REQUESTS = [
    # The dead-letter change list: each filter, the date filter, search, paging, ordering, lookups by URL
    *(
        Request(name=f"dead letters: NUL in {name}", url=DEAD_LETTERS, data={name: "acme\x00"})
        for name in ("reason", "task_name", "owner", "tenant", "status__exact", "status", "q", "p", "o")
    ),
    Request(name="dead letters: a date before year 2", url=DEAD_LETTERS, data={"last_failed_at__gte": "0001-01-01"}),
    Request(name="dead letters: a date past 9998", url=DEAD_LETTERS, data={"last_failed_at__lt": "9999-12-31"}),
    Request(name="dead letters: NUL in the date filter", url=DEAD_LETTERS, data={"last_failed_at__gte": "2026\x00"}),
    Request(name="dead letters: a message search", url=DEAD_LETTERS, data={"exc_message__icontains": "refused"}),
    Request(name="dead letters: a key lookup in JSON", url=DEAD_LETTERS, data={"kwargs__has_key": "api_token"}),
    Request(name="dead letters: a lookup on a filter's field", url=DEAD_LETTERS, data={"owner__icontains": "pay"}),
    Request(name="dead letters: a range on attempts", url=DEAD_LETTERS, data={"attempts__gt": "99999999999999999999"}),
    Request(name="dead letters: a page past the end", url=DEAD_LETTERS, data={"p": "99999999999999999999"}, expect=200),
    Request(name="dead letters: a negative page", url=DEAD_LETTERS, data={"p": "-1"}, expect=200),
    Request(
        name="dead letters: a column past the list", url=DEAD_LETTERS, data={"o": "99999999999999999999"}, expect=200
    ),
    # Actions: the ticked rows and the action's own fields
    action("action: a row that is no id", _selected_action=["abc"]),
    action("action: a row past a bigint", _selected_action=["99999999999999999999"]),
    action("action: a negative row", _selected_action=["-1"]),
    action("action: NUL in a row", _selected_action=["1\x00"]),
    action("action: NUL in select_across", select_across="\x00", post="yes"),
    # The run ledger: its filters, search, the date hierarchy (the next day or year must exist)
    *(
        Request(name=f"run ledger: NUL in {name}", url=LEDGER, data={name: "nightly\x00"})
        for name in ("status__exact", "schedule", "q", "period__gte")
    ),
    Request(name="run ledger: year 9999", url=LEDGER, data={"period__year": "9999"}),
    Request(
        name="run ledger: 9999-12-31",
        url=LEDGER,
        data={"period__year": "9999", "period__month": "12", "period__day": "31"},
    ),
    Request(name="run ledger: a year past a C long", url=LEDGER, data={"period__year": "99999999999999999999"}),
    Request(name="run ledger: year 0", url=LEDGER, data={"period__year": "0"}),
    Request(name="run ledger: a month without a year", url=LEDGER, data={"period__month": "99999999999999999999"}),
    Request(name="run ledger: month 13", url=LEDGER, data={"period__year": "2026", "period__month": "13"}),
    Request(name="run ledger: a task id search", url=LEDGER, data={"task_id__icontains": "x"}),
    # Pages that take no parameters: what is given is ignored
    Request(name="schedule health: junk", url=f"{LEDGER}health/", data={"schedule": "\x00"}, expect=200),
    Request(name="dashboard: junk", url="/admin/guardrails/dashboard/", data={"owner": "\x00"}, expect=200),
    Request(name="overview: junk", url=f"{DEAD_LETTERS}overview/", data={"reason": "\x00"}, expect=200),
    # Edit and replay: every way the posted JSON or tenant can be wrong is the form's error
    edit("edit: args 5,000 levels deep", "args", args=nested(5000)),
    edit("edit: kwargs 900 levels deep", "kwargs", kwargs=nested(900, key="a")),
    edit("edit: args 101 levels deep", "args", args=nested(101)),
    edit("edit: a number of 5,000 digits", "args", args="[" + "9" * 5000 + "]"),
    edit("edit: NaN", "args", args="[NaN]"),
    edit("edit: -Infinity", "kwargs", kwargs='{"amount": -Infinity}'),
    edit("edit: a lone surrogate", "args", args='["\\ud800"]'),
    edit("edit: a lone surrogate in a key", "kwargs", kwargs='{"\\udc00": 1}'),
    edit("edit: args as an object", "args", args='{"a": 1}'),
    edit("edit: kwargs as a list", "kwargs", kwargs="[1]"),
    edit("edit: args not JSON", "args", args="[1,"),
    edit("edit: blank args", "args", args=""),
    edit("edit: NUL in the tenant", "tenant", tenant="acme\x00"),
    edit("edit: a bidi override in the tenant", "tenant", tenant="acme\u202e"),
    edit("edit: a 10,000-character tenant", "tenant", tenant="a" * 10_000),
    Request(
        name="edit: a 10 MB body",
        url="{edit}",
        data={"tenant": "", "args": "[" + "1," * 5_000_000 + "1]", "kwargs": "{}"},
        method="post",
    ),
]


@pytest.fixture
def admin_client() -> Client:
    """A logged-in superuser without a password (pytest-django's hashes one: a quarter second a case)."""
    client = Client()
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    return client


@pytest.fixture
def record() -> DeadLetter:
    moment = datetime(2026, 11, 30, 8, tzinfo=UTC)
    ScheduledRun.objects.create(schedule="nightly", period=moment, status="ok")
    return DeadLetter.objects.create(
        task_name="tests.proj.tasks.sync_account",  # registered: a replay the form let through would publish
        task_id="task-1",
        reason="permanent",
        owner="payments",
        tenant="acme",
        args=["account", "sink"],
        kwargs={"api_token": "tok"},
        first_failed_at=moment,
        last_failed_at=moment,
    )


def filled(value: Any, record: DeadLetter) -> Any:
    edit_url = reverse("admin:guardrails_deadletter_edit_and_replay", args=[record.pk])
    if isinstance(value, str):
        return value.replace("{edit}", edit_url).replace("{pk}", str(record.pk))
    if isinstance(value, list):
        return [filled(item, record) for item in value]
    return value


@pytest.mark.parametrize("case", REQUESTS, ids=[case.name for case in REQUESTS])
def test_a_bad_request_is_a_400_or_a_form_error(admin_client: Client, record: DeadLetter, case: Request) -> None:
    # When the bad request is sent to the real view (a 500 would raise here)
    url = filled(case.url, record)
    data = {name: filled(value, record) for name, value in case.data.items()}
    response = getattr(admin_client, case.method)(url, data)
    # Then it is answered as the case says, and nothing changed
    if case.expect == FORM:
        assert response.status_code == 200, response.status_code
        assert response.context["form"].errors.get(case.field), response.context["form"].errors
        response.content.decode()  # the page shows what was typed, and can be encoded
    else:
        assert response.status_code == case.expect, (response.status_code, response.content[:300])
    if response.status_code == 400 and url in (DEAD_LETTERS, LEDGER):
        assert response.content.startswith(b"Bad request: ")  # the reason, on one line
    assert DeadLetter.objects.get(pk=record.pk).status == "open"


def test_the_declared_lookups_still_filter(admin_client: Client, record: DeadLetter) -> None:
    # Given the record above, When the list is filtered the ways its filters and links do
    for query in (
        {"status__exact": "open", "reason": "permanent"},
        {"status": "open", "owner": "payments"},  # equality on a filtered field: the filter's own index
        {
            "tenant": "acme",
            "task_name": "tests.proj.tasks.sync_account",
            "last_failed_at__gte": "2026-11-30 00:00:00+00:00",
        },
        {"q": "task-1"},
        {"owner__isnull": "False"},
    ):
        page = admin_client.get(DEAD_LETTERS, query)
        # Then each finds it
        assert page.status_code == 200, (query, page.content[:300])
        assert [row.pk for row in page.context["cl"].result_list] == [record.pk], query
    # And the ledger's date hierarchy takes a real day
    page = admin_client.get(LEDGER, {"period__year": "2026", "period__month": "11", "period__day": "30"})
    assert page.status_code == 200 and len(page.context["cl"].result_list) == 1
    # And Django's own hook says the same, for any other path that asks it
    dead_letters = site._registry[DeadLetter]
    request = RequestFactory().get(DEAD_LETTERS)
    assert dead_letters.lookup_allowed("reason", "permanent", request)
    assert dead_letters.lookup_allowed("last_failed_at__gte", "2026-11-30", request)
    assert not dead_letters.lookup_allowed("exc_message__icontains", "refused", request)
    assert not dead_letters.lookup_allowed("kwargs__has_key", "api_token", request)


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    name: str
    arguments: list[str]
    says: str


COMMANDS = [
    Command(
        name="list: an age past datetime",
        arguments=["guardrails_deadletters", "list", "--since", "99999999999999999999d"],
        says="--since '99999999999999999999d': give an age of at most 100 years",
    ),
    Command(
        name="list: an age past a float",
        arguments=["guardrails_deadletters", "list", "--since", "9" * 400 + "s"],
        says="give an age of at most 100 years",
    ),
    Command(
        name="list: year 1",
        arguments=["guardrails_deadletters", "list", "--since", "0001-01-01"],
        says="--since '0001-01-01': give a date of the years 2 to 9998",
    ),
    *(
        Command(
            name=f"list: NUL in {option}",
            arguments=["guardrails_deadletters", "list", option, "acme\x00"],
            says=f"{option} 'acme\\x00': holds a NUL character, which no stored value holds",
        )
        for option in ("--task", "--owner", "--tenant")
    ),
    *(
        Command(
            name=f"list: --limit {value}",
            arguments=["guardrails_deadletters", "list", "--limit", value],
            says=f"--limit {value!r}: give a whole number from 1 to 1,000,000",
        )
        for value in ("99999999999999999999", "²", "0", "-1", "1e3")
    ),
    Command(
        name="list: a --limit of 5,000 digits (int() refuses past 4,300)",
        arguments=["guardrails_deadletters", "list", "--limit", "9" * 5000],
        says=f"--limit {'9' * 40!r}: give a whole number from 1 to 1,000,000",
    ),
    *(
        Command(
            name=f"show {value}",
            arguments=["guardrails_deadletters", "show", value],
            says=f"{value!r} is not a dead letter id (a whole number of at most 18 digits)",
        )
        for value in ("99999999999999999999", "²", "-1")
    ),
    Command(
        name="resolve: --by of 500 characters",
        arguments=["guardrails_deadletters", "resolve", "{pk}", "--by", "x" * 500],
        says="--by: give at most 150 characters (got 500)",
    ),
    Command(
        name="resolve: a bidi override in --by",
        arguments=["guardrails_deadletters", "resolve", "{pk}", "--by", "alice\u202e"],
        says="--by 'alice\\u202e': holds a control or invisible character; give plain text",
    ),
    Command(
        name="discard: NUL in --by",
        arguments=["guardrails_deadletters", "discard", "{pk}", "--by", "alice\x00"],
        says="--by 'alice\\x00': holds a NUL character",
    ),
    Command(
        name="discard: an id past a bigint",
        arguments=["guardrails_deadletters", "discard", "{pk}", "99999999999999999999"],
        says="'99999999999999999999' is not a dead letter id",
    ),
    Command(
        name="prune: an age past datetime",
        arguments=["guardrails_prune", "--older-than", "1000000000d"],
        says="--older-than '1000000000d': give an age of at most 100 years",
    ),
    Command(
        name="prune: an age datetime holds but a date does not",
        arguments=["guardrails_prune", "--older-than", "99999999d", "--dry-run"],
        says="--older-than '99999999d': give an age of at most 100 years",
    ),
    Command(
        name="replay: an age past datetime",
        arguments=["guardrails_replay", "--since", "99999999999999999999d"],
        says="--since '99999999999999999999d': give an age of at most 100 years",
    ),
    Command(
        name="replay: NUL in --task",
        arguments=["guardrails_replay", "--task", "x\x00"],
        says="--task 'x\\x00': holds a NUL character",
    ),
    Command(
        name="replay: year 9999",
        arguments=["guardrails_replay", "--since", "9999-12-31T23:59:59-12:00"],
        says="give a date of the years 2 to 9998",
    ),
    Command(
        name="watchdog: a loop past datetime",
        arguments=["guardrails_watchdog", "--loop", "1000000000d"],
        says="--loop '1000000000d': give an age of at most 100 years",
    ),
    Command(
        name="audit: a superscript digit",
        arguments=["guardrails_audit", "--min-score", "²"],
        says="--min-score '²': give a whole number from 0 to 5",
    ),
    Command(
        name="audit: infinity",
        arguments=["guardrails_audit", "--min-average", "inf"],
        says="--min-average 'inf': give a number from 0 to 5",
    ),
    *(
        Command(
            name=f"outbox relay: --batch {value}",
            arguments=["guardrails_outbox_relay", "--once", "--batch", value],
            says=f"--batch {value!r}: give a whole number from 1 to 10,000",
        )
        for value in ("99999999999999999999", "0", "-5", "²")
    ),
    *(
        Command(
            name=f"outbox relay: --interval {value}",
            # (--once: should the check ever let a value through, the relay exits instead of looping)
            arguments=["guardrails_outbox_relay", "--once", "--interval", value],
            says=f"--interval {value!r}: give",
        )
        for value in ("nan", "0", "2d", "1000000000d")
    ),
]


@pytest.mark.parametrize("case", COMMANDS, ids=[case.name for case in COMMANDS])
def test_a_bad_value_is_a_one_line_command_error(record: DeadLetter, case: Command) -> None:
    # When the command is given the bad value
    arguments = [argument.replace("{pk}", str(record.pk)) for argument in case.arguments]
    with pytest.raises(CommandError) as raised:  # anything else would end in a traceback
        call_command(*arguments, stdout=StringIO(), stderr=StringIO())
    # Then it is one line naming the option, exit status 1, and nothing changed
    message = str(raised.value)
    assert "\n" not in message and case.says in message, message
    assert raised.value.returncode == 1
    assert DeadLetter.objects.get(pk=record.pk).status == "open"


def test_the_json_a_form_refuses_is_shown_as_typed() -> None:
    from django_celery_guardrails.forms import MAX_DEPTH, EditAndReplayForm

    # Given a form posted with arguments just inside and just past the depth allowed
    inside = EditAndReplayForm({"tenant": "", "args": nested(MAX_DEPTH), "kwargs": "{}"})
    past = EditAndReplayForm({"tenant": "", "args": nested(MAX_DEPTH + 1), "kwargs": "{}"})
    # Then the first is taken whole and the second refused, shown as it was typed
    assert inside.is_valid() and json.dumps(inside.cleaned_data["args"]) == nested(MAX_DEPTH).replace("][", "], [")
    assert not past.is_valid() and past["args"].value() == nested(MAX_DEPTH + 1)
    assert past.errors["args"] == [f"Nested more than {MAX_DEPTH} levels deep: give a flatter value."]
