"""What the admin and ``guardrails_deadletters show`` say a replay would do is what the replay does.

Four real records, from a real worker: arguments cut to a repr (over 64 KiB) with and without a sealed copy,
whole arguments with a sealed copy, and whole arguments with a redacted value and no seal key. For each, the
change list's "replay" column, the record page's "replay" field and the command's ``replay`` line say what
``replay_dead_letters`` then does (replays it, or refuses it with the same reason).
"""

from __future__ import annotations

import html
import json
import re
import uuid
from dataclasses import dataclass
from io import StringIO
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from celery_guardrails import tenant_context
from celery_guardrails.runtime.dead_letters import ARGUMENTS_LIMIT
from django_celery_guardrails.models import DeadLetter, SealedMessage
from django_celery_guardrails.replay import replay_dead_letters
from tests.conftest import Sink
from tests.proj import tasks

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30
KEY = Fernet.generate_key().decode()


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    cut: bool
    sealed: bool
    #: What every surface says: the list's word, and the sentence of the record page and the command.
    word: str
    says: str


CASES = [
    Case(
        name="cut, sealed",
        cut=True,
        sealed=True,
        word="yes",
        says="would replay, with the original arguments of its sealed copy",
    ),
    Case(
        name="cut, no seal key",
        cut=True,
        sealed=False,
        word="no",
        says="would refuse: its arguments were not stored as JSON and no sealed copy holds them",
    ),
    Case(
        name="whole, sealed",
        cut=False,
        sealed=True,
        word="yes",
        says="would replay, with the original arguments of its sealed copy",
    ),
    Case(
        name="whole, redacted, no seal key",
        cut=False,
        sealed=False,
        word="no",
        says=(
            "would refuse: secrets were redacted from its arguments and no sealed copy holds them (set seal_keys); "
            "replaying would run it with placeholders"
        ),
    ),
]


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


def failed_sync(celery_app: Any, sink: Sink, case: Case, secret: str) -> DeadLetter:
    """A real dead letter of sync_account (its provider refuses it; its api_token redacted), sealed or not, its
    options past the 64 KiB a record keeps whole when the case is cut."""
    if case.sealed:
        celery_app.conf.guardrails = {**celery_app.conf.guardrails, "seal_keys": [KEY]}
    options = {"blob": "x" * (ARGUMENTS_LIMIT + 1024)} if case.cut else {"region": "eu"}
    with tenant_context("acme"):
        result = tasks.sync_account.apply_async(
            (sink.key, sink.key), {"api_token": secret, "options": options}, max_payload_bytes=0
        )
    with pytest.raises(Exception, match="provider refused"):
        result.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=result.id)
    assert (record.arguments_are_repr, SealedMessage.objects.filter(dead_letter=record).exists()) == (
        case.cut,
        case.sealed,
    )
    return record


def unescaped(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).replace("&#x27;", "'").replace("&quot;", '"')


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_what_the_pages_and_the_command_say_is_what_the_replay_does(
    celery_worker: Any, celery_app: Any, sink: Sink, admin_client: Client, case: Case
) -> None:
    # Given a real dead letter of this case, and its cause fixed
    secret = f"tok-live-{uuid.uuid4().hex}"
    record = failed_sync(celery_app, sink, case, secret)
    sink.client.set(f"{sink.key}:fixed", 1)
    # When an admin lists it: under its reason and status, replay says yes or no, the whole sentence on hover
    listing = admin_client.get(reverse("admin:guardrails_deadletter_changelist"), {"task_name": record.task_name})
    assert listing.status_code == 200
    row = re.search(rf"<tr>(?:(?!</tr>).)*?/deadletter/{record.pk}/change/.*?</tr>", listing.content.decode(), re.S)
    assert row is not None
    said = re.search(r'<span class="dl-replay [\w-]+" title="([^"]*)">(.*?)</span>', row.group(0), re.S)
    assert said is not None and said.group(2) == f"replay: {case.word}"
    assert said.group(1).replace("&#x27;", "'") == case.says
    # and the row tells it from its neighbours: its id, its error, its arguments named as the call named them,
    # the token redacted (a cut record shows the start of its stored text), the secret nowhere
    cells = {
        name: html.unescape(title)
        for name, title in re.findall(r'<span class="dl-(error|arguments)" title="([^"]*)">', row.group(0))
    }
    assert f"#{record.pk} {record.task_id[:8]}" in unescaped(row.group(0))
    assert cells["error"] == f"PermanentError: provider refused account {sink.key}"
    if case.cut:
        assert cells["arguments"] == f"as text: ['{sink.key}', '{sink.key}']"
    else:  # (the keyword arguments in the order the database keeps them: jsonb sorts them)
        assert cells["arguments"].startswith(f'account="{sink.key}", sink="{sink.key}", ')
        assert sorted(cells["arguments"].split(", ")[2:]) == ["api_token=[redacted]", 'options={"region": "eu"}']
    assert secret not in listing.content.decode()
    # And opens it: the replay field says the same, and nothing says a cut record cannot be replayed
    page = admin_client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk])).content.decode()
    field = re.search(r'<span class="replay-outlook">(.*?)</span>', page, re.S)
    assert field is not None and unescaped(field.group(1)) == case.says
    assert "replay is not possible" not in page
    # and the stored arguments are said in words (a bare "stored as text: no" read as "replay impossible"):
    # what is shown, and whether a sealed copy holds the originals a replay sends
    stored = re.search(r'<span class="stored-arguments">(.*?)</span>', page, re.S)
    assert stored is not None
    assert unescaped(stored.group(1)) == (
        ("As text (they were not JSON, or too large): the values above are their repr. " if case.cut else "")
        + ("" if case.cut else "As JSON, with secrets redacted. ")
        + (
            "Sealed copy: yes — a replay sends the original arguments."
            if case.sealed
            else 'Sealed copy: no — a replay cannot send the original arguments (see "replay").'
        )
    )
    assert "stored as text" not in page
    # And the command says it too, in text and JSON
    out = StringIO()
    call_command("guardrails_deadletters", "show", str(record.pk), stdout=out)
    assert f"replay: {case.says}" in out.getvalue().splitlines()
    out = StringIO()
    call_command("guardrails_deadletters", "show", str(record.pk), "--json", stdout=out)
    shown = json.loads(out.getvalue())["replay"]
    assert (shown["replayable"], shown["says"]) == (case.word == "yes", case.says)
    # Then the replay does what they said
    result = replay_dead_letters([record.pk])
    if case.word == "yes":
        assert [pk for pk, _ in result.replayed] == [record.pk] and result.skipped == []
        record.refresh_from_db()
        assert celery_app.AsyncResult(record.replayed_task_id).get(timeout=TIMEOUT) == f"synced {sink.key}"
        replayed = sink.wait(2)[-1]  # with the real token, and the whole options of the original
        assert replayed["token"] == secret
        assert (
            len(json.dumps(replayed["options"])) > ARGUMENTS_LIMIT
            if case.cut
            else replayed["options"] == {"region": "eu"}
        )
    else:
        assert result.replayed == [] and result.skipped == [(record.pk, case.says.removeprefix("would refuse: "))]
        assert DeadLetter.objects.get(pk=record.pk).status == "open"
