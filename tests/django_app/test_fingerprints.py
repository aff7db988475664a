"""Dead letters grouped by cause (their fingerprints), on a real worker and the Django database: the overview, the
change list's filter, the record's page, the commands, and records made before fingerprints filled in."""

from __future__ import annotations

import json
import re
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import html

from celery_guardrails.foundation.fingerprints import fingerprint
from django_celery_guardrails.maintenance import fill_fingerprints
from django_celery_guardrails.models import DeadLetter
from tests.proj import django_tasks
from tests.support.admin_users import logged_in
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


@pytest.fixture
def outage(celery_worker: Any) -> dict[str, list[DeadLetter]]:
    """Real dead letters of two causes: three orders declined (each message naming its order and account) and
    one card expired."""
    base = uuid.uuid4().int % 10**6
    published = {
        "declined": [django_tasks.decline.delay(base + n) for n in range(3)],
        "expired": [django_tasks.decline.delay(base + 9, "expired")],
    }
    ids = {cause: [r.id for r in results] for cause, results in published.items()}
    every = [task_id for found in ids.values() for task_id in found]
    wait_for("their dead letters", lambda: DeadLetter.objects.filter(task_id__in=every).count() == len(every))
    return {cause: list(DeadLetter.objects.filter(task_id__in=found)) for cause, found in ids.items()}


def recomputed(record: DeadLetter) -> str:
    return fingerprint(
        task_name=record.task_name,
        exc_type=record.exc_type,
        exc_message=record.exc_message,
        traceback=record.traceback,
    )


def test_the_records_of_one_cause_share_a_fingerprint_and_another_cause_has_its_own(
    outage: dict[str, list[DeadLetter]],
) -> None:
    declined, (expired,) = outage["declined"], outage["expired"]
    # Then the three declines, each naming another order, share one fingerprint; the expired card has another
    assert len({r.exc_message for r in declined}) == 3
    assert len({r.fingerprint for r in declined}) == 1
    assert re.fullmatch(r"[0-9a-f]{16}", declined[0].fingerprint)
    assert expired.fingerprint not in ("", declined[0].fingerprint)
    # And each is what the record itself says (what fills in records made before fingerprints)
    assert [recomputed(r) for r in [*declined, expired]] == [r.fingerprint for r in [*declined, expired]]


def test_the_overview_lists_causes_and_links_each_to_its_records(outage: dict[str, list[DeadLetter]]) -> None:
    declined, (expired,) = outage["declined"], outage["expired"]
    client = logged_in()
    # When the overview is opened
    page = client.get(reverse("admin:guardrails_deadletter_overview"))
    assert page.status_code == 200
    # Then it lists the causes, biggest first, with their counts, first and last failures, in words
    causes = [(c.fingerprint, c.count, c.task_name) for c in page.context["overview"].by_cause]
    task = "tests.proj.django_tasks.decline"
    assert causes == [(declined[0].fingerprint, 3, task), (expired.fingerprint, 1, task)]
    top = page.context["overview"].by_cause[0]
    assert top.first_seen == min(r.first_failed_at for r in declined)
    assert top.last_seen == max(r.last_failed_at for r in declined)
    assert top.title == (
        "celery_guardrails.exceptions.PermanentError in tests/proj/django_tasks.py:decline: "
        "order <n> declined by provider account '<q>'"
    )
    assert html.escape(top.title).encode() in page.content
    # When its link is followed
    link = f"status__exact=open&amp;fingerprint={top.fingerprint}".encode()
    assert link in page.content
    listing = client.get(reverse("admin:guardrails_deadletter_changelist"), {"fingerprint": top.fingerprint})
    # Then the change list shows that cause's records only, and names the cause in its filter
    assert listing.status_code == 200
    assert {r.pk for r in listing.context["cl"].result_list} == {r.pk for r in declined}
    assert b"order &lt;n&gt; declined by provider account" in listing.content
    # And a record's page links to its cause
    detail = client.get(reverse("admin:guardrails_deadletter_change", args=[expired.pk]))
    assert f"?fingerprint={expired.fingerprint}".encode() in detail.content
    assert b"order &lt;n&gt;: card expired" in detail.content


def test_the_commands_list_causes_and_list_and_replay_one_cause(outage: dict[str, list[DeadLetter]]) -> None:
    declined = outage["declined"]
    cause = declined[0].fingerprint
    # When the causes are listed
    out = StringIO()
    call_command("guardrails_deadletters", "causes", "--json", stdout=out)
    listed = [json.loads(line) for line in out.getvalue().splitlines()]
    # Then each cause is a line with its count and name
    assert [(c["fingerprint"], c["count"]) for c in listed][:2] == [(cause, 3), (outage["expired"][0].fingerprint, 1)]
    assert listed[0]["title"].endswith("order <n> declined by provider account '<q>'")
    # And one cause's records are listed, and a replay of it is planned, by its fingerprint
    out = StringIO()
    call_command("guardrails_deadletters", "list", "--fingerprint", cause, "--json", stdout=out)
    assert {json.loads(line)["id"] for line in out.getvalue().splitlines()} == {r.pk for r in declined}
    out = StringIO()
    call_command("guardrails_replay", "--fingerprint", cause, "--dry-run", stdout=out)
    assert out.getvalue().splitlines()[-1] == "3 dead letter(s) would be replayed, 0 refused."


def test_records_made_before_fingerprints_are_filled_in_as_the_worker_would(
    outage: dict[str, list[DeadLetter]],
) -> None:
    records = [*outage["declined"], *outage["expired"]]
    made = {r.pk: r.fingerprint for r in records}
    # Given the records as a release before fingerprints left them
    DeadLetter.objects.filter(pk__in=made).update(fingerprint="")
    page = logged_in().get(reverse("admin:guardrails_deadletter_overview"))
    assert page.context["overview"].unsorted_count >= 4 and b"unsorted-count" in page.content
    # When they are filled in, two records a batch
    filled = fill_fingerprints(batch=2)
    # Then each gets the fingerprint the worker gave it, and a second run has nothing to do
    assert filled >= 4
    assert dict(DeadLetter.objects.filter(pk__in=made).values_list("pk", "fingerprint")) == made
    out = StringIO()
    call_command("guardrails_deadletters", "fingerprint", stdout=out)
    assert out.getvalue().strip() == "Filled in the fingerprint of 0 dead letter(s)."
