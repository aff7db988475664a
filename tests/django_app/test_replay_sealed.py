"""Replay of the dead letters people most need to replay: secrets redacted (sealed copies), a missing tenant,
a fix made in the admin's "edit and replay" form; what a dry run says; key rotation; a sealed copy moved onto
another record."""

from __future__ import annotations

import json
import uuid
from io import StringIO
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.urls import reverse

from celery_guardrails import tenant_context
from django_celery_guardrails.models import DeadLetter, SealedMessage
from django_celery_guardrails.replay import Refused, plan, replay_dead_letters
from tests.conftest import Sink
from tests.proj import tasks
from tests.support.admin_users import staff_user

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30
KEY = Fernet.generate_key().decode()


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "seal_keys": [KEY]}
    return celery_app


@pytest.fixture
def secret() -> str:
    return f"tok-live-{uuid.uuid4().hex}"


def failed_sync(
    sink: Sink, secret: str, *, tenant: str = "acme", account: str | None = None, **options: Any
) -> DeadLetter:
    """A real dead letter: sync_account refused by its provider (permanent), its api_token a secret. The
    account (and so the idempotency key) is the sink's unless given: each test has its own."""
    with tenant_context(tenant):
        result = tasks.sync_account.apply_async((account or sink.key, sink.key), {"api_token": secret, **options})
    with pytest.raises(Exception, match="provider refused"):
        result.get(timeout=TIMEOUT)
    return DeadLetter.objects.get(task_id=result.id)


def everything_stored() -> str:
    """Every row of the guardrails' dead-letter tables and the admin log, as text."""
    rows = []
    with connection.cursor() as cursor:
        for table in ("guardrails_deadletter", "guardrails_sealedmessage", "django_admin_log"):
            cursor.execute(f"SELECT * FROM {table}")
            rows += [repr(row) for row in cursor.fetchall()]
    return "\n".join(rows)


def fix_the_cause(sink: Sink) -> None:
    sink.client.set(f"{sink.key}:fixed", 1)


def test_a_record_whose_token_was_redacted_replays_with_the_real_token(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given a dead letter whose api_token kwarg was redacted for display
    record = failed_sync(sink, secret)
    assert record.kwargs["api_token"] == "[redacted]"
    # Then no table holds the token in clear, and the record has a sealed copy
    assert SealedMessage.objects.filter(dead_letter=record).exists()
    assert secret not in everything_stored()
    # When the cause is fixed and the record replayed
    fix_the_cause(sink)
    ((_, task_id),) = replay_dead_letters([record.pk], user=staff_user("replay_deadletter")).replayed
    # Then the task runs with the real token, its tenant and key, and succeeds
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"synced {sink.key}"
    first, second = sink.wait(2)
    assert (second["token"], second["tenant"], second["key"]) == (secret, "acme", first["key"])
    assert secret not in everything_stored()


def test_edit_and_replay_keeps_what_was_redacted_and_takes_the_edit(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given a dead letter of a call with the wrong region, and a user who may replay
    record = failed_sync(sink, secret, options={"region": "us"})
    client = Client()
    client.force_login(staff_user("replay_deadletter"))
    url = reverse("admin:guardrails_deadletter_edit_and_replay", args=[record.pk])
    # When they open the form: it shows the arguments redacted, never the token
    page = client.get(url)
    assert page.status_code == 200 and b"[redacted]" in page.content and secret.encode() not in page.content
    # And a bad edit is refused by the form, nothing replayed
    bad = client.post(url, {"tenant": "acme", "args": '["unclosed', "kwargs": "{}"})
    assert bad.status_code == 200 and b"Enter a valid JSON" in bad.content
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    # When they fix the region, leave the token as shown, and replay
    fix_the_cause(sink)
    kwargs = '{"api_token": "[redacted]", "options": {"region": "eu"}}'
    done = client.post(url, {"tenant": "acme", "args": f'["{sink.key}", "{sink.key}"]', "kwargs": kwargs}, follow=True)
    assert b"Replayed 1 dead letter(s)." in done.content
    # Then the task ran with the real token and the new region
    record.refresh_from_db()
    assert celery_app.AsyncResult(record.replayed_task_id).get(timeout=TIMEOUT) == f"synced {sink.key}"
    replay = sink.wait(2)[-1]
    assert (replay["token"], replay["options"]) == (secret, {"region": "eu"})
    # And the LogEntry names what changed, without values
    (entry,) = LogEntry.objects.filter(object_id=str(record.pk))
    assert entry.change_message == (f"Replayed as task {record.replayed_task_id}; changed keyword arguments (options)")
    assert secret not in everything_stored()


def test_a_missing_tenant_record_replays_with_the_tenant_given(celery_worker: Any, celery_app: Any, sink: Sink) -> None:
    # Given a tenant-required task published without a tenant (by a plain Celery publisher)
    result = celery_app.send_task("tests.proj.tasks.tenant_only", args=[sink.key])
    with pytest.raises(Exception, match="tenant"):
        result.get(timeout=TIMEOUT)
    record = DeadLetter.objects.get(task_id=result.id)
    assert record.reason == "missing_tenant"
    # Then a dry run with the command says it would be replayed as acme
    out = StringIO()
    call_command("guardrails_replay", "--reason", "missing_tenant", "--tenant", "acme", "--dry-run", stdout=out)
    assert f"would replay {record.pk}" in out.getvalue()
    # When it is replayed with tenant="acme"
    ((_, task_id),) = replay_dead_letters([record.pk], tenant="acme").replayed
    # Then the task sees acme
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)["tenant"] == "acme"
    assert sink.wait(1)[0]["tenant"] == "acme"


def test_without_a_sealed_copy_a_redacted_record_is_refused_and_the_dry_run_says_so(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given a record with a redacted token and no sealed copy (recorded before seal_keys were set)
    record = failed_sync(sink, secret)
    SealedMessage.objects.filter(dead_letter=record).delete()
    fix_the_cause(sink)
    # When a dry run is asked: it says it would refuse it, and exits non-zero
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="1 dead letter\\(s\\) would be refused"):
        call_command("guardrails_replay", "--task", tasks.sync_account.name, "--dry-run", stdout=out, stderr=err)
    assert f"would refuse {record.pk}" in err.getvalue() and "no sealed copy holds them" in err.getvalue()
    # And the real run does what the dry run said: refuses, non-zero, the record open, nothing published
    with pytest.raises(CommandError, match="1 dead letter\\(s\\) refused"):
        call_command("guardrails_replay", "--task", tasks.sync_account.name, stdout=out, stderr=err)
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    assert len(sink.items()) == 1
    # But an edit that gives the token replays it
    from django_celery_guardrails.replay import replay_with_changes

    result = replay_with_changes(record.pk, kwargs={"api_token": secret})
    assert len(result.replayed) == 1


def test_rotating_keys_reseals_every_copy_and_a_dropped_key_is_a_clear_refusal(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given a record sealed with KEY
    record = failed_sync(sink, secret)
    before = SealedMessage.objects.get(dead_letter=record).token
    new = Fernet.generate_key().decode()
    guardrails = celery_app.conf.guardrails
    try:
        # When a new key is put first and the copies sealed again
        celery_app.conf.guardrails = {**guardrails, "seal_keys": [new, KEY]}
        out = StringIO()
        call_command("guardrails_deadletters", "reseal", stdout=out)
        assert out.getvalue().strip() == "Sealed 1 copy(ies) again with the first key."
        assert SealedMessage.objects.get(dead_letter=record).token != before
        # Then the old key can be dropped: the record still replays
        celery_app.conf.guardrails = {**guardrails, "seal_keys": [new]}
        assert plan(record).kwargs["api_token"] == secret
        # And with only a key that never sealed it, the replay is refused, saying why
        celery_app.conf.guardrails = {**guardrails, "seal_keys": [Fernet.generate_key().decode()]}
        with pytest.raises(Refused, match="its sealed copy cannot be opened: none of the configured seal_keys"):
            plan(record)
        assert replay_dead_letters([record.pk]).skipped[0][1].startswith("its sealed copy cannot be opened")
        assert DeadLetter.objects.get(pk=record.pk).status == "open"
    finally:
        celery_app.conf.guardrails = guardrails


def test_the_sealed_copy_goes_with_its_record(celery_worker: Any, sink: Sink, secret: str) -> None:
    record = failed_sync(sink, secret)
    assert SealedMessage.objects.filter(dead_letter_id=record.pk).count() == 1
    record.delete()
    assert not SealedMessage.objects.filter(dead_letter_id=record.pk).exists()


def test_without_the_replay_permission_no_replay_is_offered(celery_worker: Any, sink: Sink, secret: str) -> None:
    # Given a staff user who may view, discard and resolve dead letters, but not replay them
    record = failed_sync(sink, secret)
    client = Client()
    client.force_login(staff_user("discard_deadletter", "resolve_deadletter"))
    # Then the detail page offers no Replay and no Edit and replay, and no Save
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk]))
    assert detail.status_code == 200
    assert b"replay-link" not in detail.content and b"edit-replay-link" not in detail.content
    assert b'name="_save"' not in detail.content
    # And the change list has no replay action
    listing = client.get(reverse("admin:guardrails_deadletter_changelist"))
    assert b"replay_selected" not in listing.content and b"discard_selected" in listing.content
    # And the replay pages answer 403
    for name in ("admin:guardrails_deadletter_replay", "admin:guardrails_deadletter_edit_and_replay"):
        assert client.get(reverse(name, args=[record.pk])).status_code == 403
    # While a user who may replay sees both buttons
    client.force_login(staff_user("replay_deadletter"))
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk]))
    assert b"replay-link" in detail.content and b"edit-replay-link" in detail.content


def test_a_replay_that_fails_again_links_its_new_dead_letter(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given a dead letter replayed before its cause was fixed
    record = failed_sync(sink, secret)
    ((_, task_id),) = replay_dead_letters([record.pk]).replayed
    with pytest.raises(Exception, match="provider refused"):
        celery_app.AsyncResult(task_id).get(timeout=TIMEOUT)
    again = DeadLetter.objects.get(task_id=task_id)
    # When its page is opened
    client = Client()
    client.force_login(staff_user("replay_deadletter"))
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[record.pk]))
    # Then "replayed as" links the new dead letter (which keeps the real token sealed too)
    url = reverse("admin:guardrails_deadletter_change", args=[again.pk])
    assert f'href="{url}" class="replayed-again">failed again: dead letter {again.pk}</a>'.encode() in detail.content
    assert plan(again).kwargs["api_token"] == secret


def move_sealed_copy(source: DeadLetter, target: DeadLetter) -> None:
    """What someone who can write one row does: ``source``'s sealed copy written onto ``target``'s record."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE guardrails_sealedmessage SET token = (SELECT token FROM guardrails_sealedmessage "
            "WHERE dead_letter_id = %s) WHERE dead_letter_id = %s",
            [source.pk, target.pk],
        )


def acme_and_globex(sink: Sink, secret: str) -> tuple[DeadLetter, DeadLetter, str]:
    """Record 'acme' (tenant acme, ``secret``) and record 'globex' (tenant globex, its own token and account),
    each with its sealed copy; and globex's token."""
    acme = failed_sync(sink, secret)
    theirs = f"tok-globex-{uuid.uuid4().hex}"
    globex = failed_sync(sink, theirs, tenant="globex", account=f"{sink.key}-globex")
    assert SealedMessage.objects.filter(dead_letter__in=[acme, globex]).count() == 2
    return acme, globex, theirs


def refused_and_untouched(record: DeadLetter) -> None:
    """``record`` is refused because its copy is another record's, stays open, and nothing is published."""
    with pytest.raises(Refused, match="its sealed copy cannot be opened: the sealed copy belongs to another record"):
        plan(record)
    result = replay_dead_letters([record.pk])
    assert result.replayed == []
    assert result.skipped == [
        (record.pk, "its sealed copy cannot be opened: the sealed copy belongs to another record")
    ]
    assert DeadLetter.objects.filter(pk=record.pk, status="open", replayed_task_id="").exists()


def test_a_sealed_copy_moved_onto_another_record_does_not_replay_there(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given acme's record and globex's record, each with its sealed copy
    acme, globex, theirs = acme_and_globex(sink, secret)
    fix_the_cause(sink)
    # When acme's sealed copy is written onto globex's record (one UPDATE)
    move_sealed_copy(acme, globex)
    # Then globex's record does not replay acme's arguments as globex: refused, open, nothing published
    refused_and_untouched(globex)
    # And acme's untouched record still replays, as acme, with its own token
    ((_, task_id),) = replay_dead_letters([acme.pk]).replayed
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"synced {sink.key}"
    # And the only runs were the two failures and acme's replay (one worker, in publish order)
    runs = [(run["tenant"], run["account"], run["token"]) for run in sink.items()]
    assert runs == [("acme", sink.key, secret), ("globex", f"{sink.key}-globex", theirs), ("acme", sink.key, secret)]


def as_the_release_before(record: DeadLetter) -> None:
    """``record``'s sealed copy made again as the release before sealed it: document version 1, no identity."""
    sealed = SealedMessage.objects.get(dead_letter=record)
    document = json.loads(Fernet(KEY.encode()).decrypt(sealed.token.encode()))
    old = {"v": 1, "args": document["args"], "kwargs": document["kwargs"], "header": document["header"]}
    sealed.token = Fernet(KEY.encode()).encrypt(json.dumps(old).encode()).decode()
    sealed.save()


def test_a_copy_sealed_by_the_release_before_replays_for_its_own_record_only(
    celery_worker: Any, celery_app: Any, sink: Sink, secret: str
) -> None:
    # Given two records whose copies were sealed before the upgrade (version 1: no identity inside)
    acme, globex, _ = acme_and_globex(sink, secret)
    for record in (acme, globex):
        as_the_release_before(record)
    fix_the_cause(sink)
    # Then each still opens for its own record, with the real token
    assert plan(acme).kwargs["api_token"] == secret
    # But moved onto the other record (another tenant), it is refused there, nothing published
    move_sealed_copy(acme, globex)
    refused_and_untouched(globex)
    # And the record it belongs to replays
    ((_, task_id),) = replay_dead_letters([acme.pk]).replayed
    assert celery_app.AsyncResult(task_id).get(timeout=TIMEOUT) == f"synced {sink.key}"
    assert [run["tenant"] for run in sink.items()] == ["acme", "globex", "acme"]
