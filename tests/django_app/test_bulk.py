"""Bulk actions on every open dead letter a filter matches (django_celery_guardrails.bulk), on dead letters a
real worker made: batch by batch with progress and one LogEntry each, stopped between batches by the job's
cancel, the replay's own refusals and permissions, and end to end as a job on the worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied

from celery_guardrails.guardrails.jobs import RunningJob
from django_celery_guardrails.bulk import Matching, run, start
from django_celery_guardrails.models import DeadLetter, Job
from django_celery_guardrails.tasks import bulk_dead_letters
from tests.proj import django_tasks
from tests.support.admin_users import staff_user
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
TIMEOUT = 30


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"], "job_outbox": False}
    return celery_app


@pytest.fixture
def outage(celery_worker: Any) -> dict[str, Any]:
    """Seven orders declined (one cause), and one card expired (another), as a real worker records them."""
    base = uuid.uuid4().int % 10**6
    results = [django_tasks.decline.delay(base + n) for n in range(7)] + [django_tasks.decline.delay(base, "x")]
    ids = [r.id for r in results]
    wait_for("the dead letters", lambda: DeadLetter.objects.filter(task_id__in=ids).count() == len(ids))
    records = [DeadLetter.objects.get(task_id=task_id) for task_id in ids]
    return {"declined": records[:7], "expired": records[7], "cause": records[0].fingerprint}


def test_a_replay_of_one_cause_goes_batch_by_batch_with_progress_and_a_log_entry_each(outage: dict[str, Any]) -> None:
    user = staff_user("replay_deadletter")
    matching = Matching.now(fingerprint=outage["cause"])
    reported: list[tuple[int, int]] = []
    # When every record of the cause is replayed, three at a time
    result = run("replay", matching, user=user, batch=3, progress=lambda done, total: reported.append((done, total)))
    # Then all seven are replayed once each, in three batches, and the other cause is left open
    assert (result.done, result.batches, dict(result.refused), result.stopped) == (7, 3, {}, False)
    assert reported == [(3, 7), (6, 7), (7, 7)]
    declined = DeadLetter.objects.filter(pk__in=[r.pk for r in outage["declined"]])
    assert set(declined.values_list("status", flat=True)) == {"replayed"}
    assert len(set(declined.values_list("replayed_task_id", flat=True))) == 7
    assert DeadLetter.objects.get(pk=outage["expired"].pk).status == "open"
    # And each batch wrote one LogEntry naming the action, the filter and the counts
    entries = list(LogEntry.objects.filter(user=user).order_by("pk").values_list("change_message", flat=True))
    filtered = f"matching fingerprint={outage['cause']}, up to #{matching.up_to}"
    assert entries == [f"Bulk replay: {n} of {n} {filtered}" for n in (3, 3, 1)]


def test_a_cancel_stops_it_between_batches_and_records_recorded_later_are_not_taken(outage: dict[str, Any]) -> None:
    user = staff_user("resolve_deadletter")
    declined = outage["declined"]
    # Given a filter asked before a later record of the same cause came
    matching = Matching.now(fingerprint=outage["cause"])
    later = django_tasks.decline.delay(uuid.uuid4().int % 10**6)
    wait_for("the later record", lambda: DeadLetter.objects.filter(task_id=later.id).exists())
    # When its cancel is asked as the first batch of three ends
    result = run("resolve", matching, user=user, batch=3, stop=lambda: True)
    # Then that batch only was resolved, and the rest stays open
    assert (result.done, result.batches, result.stopped) == (3, 1, True)
    statuses = [DeadLetter.objects.get(pk=r.pk).status for r in declined]
    assert statuses == ["resolved"] * 3 + ["open"] * 4
    # And run to its end, it takes the rest but not the record that came later
    assert run("resolve", matching, user=user).done == 4
    assert DeadLetter.objects.get(task_id=later.id).status == "open"


def test_the_replays_own_refusals_and_permissions_hold(outage: dict[str, Any]) -> None:
    matching = Matching.now(fingerprint=outage["cause"])
    # A user without the permission is refused before anything is submitted or done
    with pytest.raises(PermissionDenied):
        start("replay", matching, user=staff_user("resolve_deadletter"))
    with pytest.raises(PermissionDenied):
        run("discard", matching, user=staff_user("replay_deadletter"))
    assert set(DeadLetter.objects.filter(fingerprint=outage["cause"]).values_list("status", flat=True)) == {"open"}
    # A not_idempotent record is refused by the replay's own rule, counted by its reason
    first = outage["declined"][0]
    DeadLetter.objects.filter(pk=first.pk).update(reason="not_idempotent")
    result = run("replay", matching, user=staff_user("replay_deadletter"))
    assert result.done == 6
    ((why, count),) = result.refused.items()
    assert count == 1 and why.startswith("not_idempotent")
    assert DeadLetter.objects.get(pk=first.pk).status == "open"


def test_as_a_job_on_the_worker_it_reports_progress_and_reads_its_cancel(
    celery_app: Any, outage: dict[str, Any]
) -> None:
    # (the worker registers the guardrails' tasks as autodiscover_tasks() finds them in a project)
    assert bulk_dead_letters.name in celery_app.tasks
    user = staff_user("discard_deadletter")
    # When the discard of the cause is started as a job
    job = start("discard", Matching.now(fingerprint=outage["cause"]), user=user)
    # Then the worker runs it to succeeded, with its progress, and every record of the cause is discarded
    wait_for("the job succeeded", lambda: Job.objects.get(pk=job.pk).state == "succeeded", timeout=TIMEOUT)
    job.refresh_from_db()
    assert (job.progress_done, job.progress_total) == (7, 7)
    assert set(DeadLetter.objects.filter(fingerprint=outage["cause"]).values_list("status", flat=True)) == {"discarded"}
    assert LogEntry.objects.filter(user=user, change_message__startswith="Bulk discard: 7 of 7").count() == 1
    # And a running job's body reads a cancel asked meanwhile from the job's record
    running = RunningJob(task=django_tasks.decline, job_id=str(job.pk))
    assert running.cancel_requested() is False
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=job.finished_at)
    assert running.cancel_requested() is True


def test_the_replay_command_runs_it_in_the_background(celery_app: Any, outage: dict[str, Any]) -> None:
    from io import StringIO

    from django.core.management import call_command

    assert bulk_dead_letters.name in celery_app.tasks
    out = StringIO()
    # When the command is asked to replay one cause in the background
    call_command("guardrails_replay", "--fingerprint", outage["cause"], "--since", "1h", "--background", stdout=out)
    # Then it says which job does it, and the job replays the cause's seven records
    job_id = out.getvalue().split()[2].rstrip(":")
    wait_for("the job succeeded", lambda: Job.objects.get(pk=job_id).state == "succeeded", timeout=TIMEOUT)
    declined = DeadLetter.objects.filter(pk__in=[r.pk for r in outage["declined"]])
    assert set(declined.values_list("status", flat=True)) == {"replayed"}
    assert DeadLetter.objects.get(pk=outage["expired"].pk).status == "open"


def test_the_change_list_offers_all_matching_counts_them_first_and_starts_the_job(
    celery_app: Any, outage: dict[str, Any]
) -> None:
    from django.test import Client
    from django.urls import reverse

    assert bulk_dead_letters.name in celery_app.tasks
    user = staff_user("replay_deadletter")
    client = Client()
    client.force_login(user)
    first = outage["declined"][0]
    DeadLetter.objects.filter(pk=first.pk).update(reason="not_idempotent")
    cause = {"fingerprint": outage["cause"]}
    # Given the change list filtered to one cause: it offers to replay all matching (not to discard: no permission)
    listing = client.get(reverse("admin:guardrails_deadletter_changelist"), cause)
    link = f"{reverse('admin:guardrails_deadletter_bulk', args=['replay'])}?fingerprint={outage['cause']}"
    assert link.encode() in listing.content and b'id="bulk-discard"' not in listing.content
    # When it is followed: the count first, what the replay would refuse, and the not_idempotent tick
    page = client.get(link)
    assert page.status_code == 200
    assert b"7 open dead letters match" in page.content
    assert b"The replay refuses none of the first 7." in page.content
    assert b'id="allow-not-idempotent"' in page.content
    # And once confirmed (without the tick), a job replays them and its page is opened
    answer = client.post(link, {"post": "yes", "up_to": page.context["up_to"]})
    assert answer.status_code == 302
    job = Job.objects.get(task_name="django_celery_guardrails.bulk_dead_letters", pk=answer["Location"].split("/")[-3])
    wait_for("the job succeeded", lambda: Job.objects.get(pk=job.pk).state == "succeeded", timeout=TIMEOUT)
    statuses = {r.pk: DeadLetter.objects.get(pk=r.pk).status for r in outage["declined"]}
    assert statuses == {r.pk: "open" if r.pk == first.pk else "replayed" for r in outage["declined"]}
    entry = LogEntry.objects.get(user=user, change_message__startswith="Bulk replay")
    assert entry.change_message.startswith(f"Bulk replay: 6 of 7 matching fingerprint={outage['cause']}")
    assert "1 not: not_idempotent" in entry.change_message
    # And a user without the permission, or a filter the list does not take, is refused
    assert client.get(reverse("admin:guardrails_deadletter_bulk", args=["discard"])).status_code == 403
    assert client.get(f"{link}&exc_message__icontains=x").status_code == 400


def test_a_bulk_job_is_cancelled_from_its_own_page(celery_app: Any) -> None:
    from django.test import Client
    from django.urls import reverse
    from django.utils import timezone

    # Given a bulk replay asked while no worker runs (its job queued), by a user who may also cancel jobs
    now = timezone.now()
    record = DeadLetter.objects.create(
        task_name="t.gone", task_id=f"gone-{uuid.uuid4()}", reason="permanent", first_failed_at=now, last_failed_at=now
    )
    user = staff_user("replay_deadletter", "view_job", "change_job")
    job = start("replay", Matching.now(task_name="t.gone"), user=user)
    client = Client()
    client.force_login(user)
    # When its page's Cancel button is used, and the cancel confirmed
    page = client.get(reverse("admin:guardrails_job_change", args=[job.pk]))
    assert b'id="cancel-job"' in page.content
    form = {"action": "cancel_selected", "index": "0", "select_across": "0", "_selected_action": str(job.pk)}
    changelist = reverse("admin:guardrails_job_changelist")
    assert client.post(changelist, form).status_code == 200  # the confirmation
    assert client.post(changelist, {**form, "post": "yes"}).status_code == 302
    # Then the job is cancelled (its message, when a worker takes it, does not run), the record untouched, and the
    # page offers no second cancel
    assert Job.objects.get(pk=job.pk).state == "cancelled"
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    assert b'id="cancel-job"' not in client.get(reverse("admin:guardrails_job_change", args=[job.pk])).content


def test_the_all_matching_page_takes_the_lists_dates_and_searches(celery_app: Any) -> None:
    from datetime import timedelta

    from django.test import Client
    from django.urls import reverse
    from django.utils import timezone

    # Given two records of one task two days apart, one with an order argument (two, not one: the bound
    # below sits an hour before midnight, and a record one day old falls after it when the test runs
    # in the last hour of a UTC day)
    now = timezone.now()
    name = f"t.dated.{uuid.uuid4().hex[:6]}"
    for days, kwargs in ((0, {"order_id": 42}), (2, {})):
        moment = now - timedelta(days=days)
        DeadLetter.objects.create(
            task_name=name, task_id=f"{name}-{days}", reason="permanent", kwargs=kwargs,
            first_failed_at=moment, last_failed_at=moment,
        )  # fmt: skip
    client = Client()
    client.force_login(staff_user("resolve_deadletter"))
    url = reverse("admin:guardrails_deadletter_bulk", args=["resolve"])
    today = now.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(hours=1)

    def counted(**query: str) -> bytes:
        page = client.get(url, {"task_name__exact": name, **query})
        assert page.status_code == 200
        return page.content

    # Then the date filter's bounds (with and without a zone), an argument and a redacted value are each taken
    assert b"1 open dead letter matches" in counted(last_failed_at__gte=today.isoformat())
    assert b"1 open dead letter matches" in counted(last_failed_at__gte=today.replace(tzinfo=None).isoformat())
    assert b"1 open dead letter matches" in counted(q="order_id=42")
    assert b"0 open dead letters match" in counted(q="order_id=[redacted]")
    # And the list's empty choice (no owner) is a filter, not "any owner"
    DeadLetter.objects.filter(task_id=f"{name}-2").update(owner="payments")
    assert b"1 open dead letter matches" in counted(owner__exact="")
