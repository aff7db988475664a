"""Tenant scoping of the admin (``admin_tenants``): two staff users of two tenants, with dead letters, ledger
records, slots and outbox messages of three tenants (and some of none), through a real Django test client on
PostgreSQL and SQLite; replays published to the real broker. Unset, everyone sees everything, as before."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from django.conf import LazySettings
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from celery_guardrails.exceptions import ConfigurationError, ContextError
from celery_guardrails.options import TASK, app_settings, validate
from celery_guardrails.scheduling.ledger import OK
from django_celery_guardrails.checks import check_admin_tenants, check_settings
from django_celery_guardrails.maintenance import close_dead_letters
from django_celery_guardrails.models import (
    ConcurrencySlot,
    DeadLetter,
    DependencyState,
    IdempotencyKey,
    OutboxMessage,
    ScheduledRun,
)
from django_celery_guardrails.replay import replay_dead_letters, replay_with_changes
from django_celery_guardrails.scoping import (
    ALL_CODENAME,
    ALL_TENANTS,
    HIDDEN,
    TENANT_PERMISSION_MAX,
    tenant_codename,
    tenant_permission,
    visible_tenants,
)
from django_celery_guardrails.store import DjangoStore
from tests.conftest import waiting_messages
from tests.proj import tasks

pytestmark = pytest.mark.django_db

TASK_NAME = tasks.charge.name  # a registered task: its records replay
# Each tenant's records have a reason, an owner and a second task of their own, so a filter's choices and the
# dashboard's figures say whose they are. "" is the records without a tenant.
REASONS = {"acme": "permanent", "globex": "circuit_open", "initech": "poison", "": "missing_tenant"}
OWNERS = {"acme": "payments", "globex": "billing", "initech": "ops", "": "platform"}
#: The guarded schedules and their tenants: the policy's, the beat entry's own (initech), none (housekeeping).
SCHEDULE_TENANTS = {"acme nightly": "acme", "globex nightly": "globex", "initech sync": "initech", "housekeeping": ""}
DEAD_LETTERS = "admin:guardrails_deadletter_changelist"
LEDGER = "admin:guardrails_scheduledrun_changelist"

#: Who sees which tenants with the callable (a test swaps an answer for a wrong one or an exception).
STAFF: dict[str, Any] = {"acme-staff": ["acme"], "globex-staff": ["globex"]}


def tenants_of(user: Any) -> Any:
    """The admin_tenants callable of these tests (as a project would write one): the staff's tenants, every
    tenant for other superusers, none for anyone else."""
    if user.username not in STAFF:
        return ALL_TENANTS if user.is_superuser else []
    answer = STAFF[user.username]
    if isinstance(answer, Exception):
        raise answer
    return answer


NOT_CALLABLE = 42


def others(tenant: str) -> set[str]:
    """The names a page of ``tenant``'s user must never show: the other tenants'."""
    return {"acme", "globex", "initech"} - {tenant}


@pytest.fixture
def app(celery_app: Celery) -> Celery:
    """The test's Celery app (replays publish to its queue on the real broker), with guarded schedules of three
    tenants and one of none; the admin reads its policies (it is the current app)."""
    celery_app.conf.guardrails = {
        **celery_app.conf.guardrails,
        "store": "django",
        "dead_letter_sinks": ["django"],
        "schedules": {
            "acme nightly": {"tenant": "acme"},
            "globex nightly": {"tenant": "globex"},
            "initech sync": {},
            "housekeeping": {},
        },
    }
    celery_app.conf.beat_schedule = {name: {"task": TASK_NAME, "schedule": 3600.0} for name in SCHEDULE_TENANTS}
    celery_app.conf.beat_schedule["initech sync"]["options"] = {"tenant": "initech"}
    return celery_app


def letter(tenant: str, n: int, *, task: str = TASK_NAME, at: datetime | None = None) -> DeadLetter:
    """An open dead letter of ``tenant``, as a worker records it (replayable: its task is registered)."""
    moment = at or timezone.now()
    return DeadLetter.objects.create(
        task_name=task,
        task_id=f"{tenant or 'untenanted'}-{n}-{uuid.uuid4().hex[:8]}",
        args=[n, f"sink-{tenant}", ["ok"]],
        header={"tenant": tenant} if tenant else {},
        tenant=tenant,
        reason=REASONS[tenant],
        owner=OWNERS[tenant],
        first_failed_at=moment,
        last_failed_at=moment,
    )


@pytest.fixture
def world(app: Celery) -> dict[str, list[DeadLetter]]:
    """Per tenant ("" for none): two open dead letters of the charge task and one of a task of its own (an hour
    ago); ledger records of every schedule and of one whose policy is gone; a slot and an outbox message each;
    idempotency keys and a dependency state (every tenant's together)."""
    store, now = DjangoStore(), timezone.now()
    records: dict[str, list[DeadLetter]] = {}
    for tenant in REASONS:
        own = f"tests.proj.tasks.{tenant or 'untenanted'}_report"
        records[tenant] = [
            letter(tenant, 1),
            letter(tenant, 2),
            letter(tenant, 3, task=own, at=now - timedelta(hours=1)),
        ]
        ConcurrencySlot.objects.create(
            key=f"limit:{tenant}", holder=f"h-{tenant}", task_id=f"slot-{tenant}", tenant=tenant, acquired_at=now,
            heartbeat_at=now,
        )  # fmt: skip
        OutboxMessage.objects.create(
            task_name=TASK_NAME, task_id=f"outbox-{tenant or 'untenanted'}", body="[]", tenant=tenant, available_at=now
        )
    period = (now - timedelta(hours=2)).timestamp() // 3600 * 3600
    for schedule in [*SCHEDULE_TENANTS, "gone"]:
        store.run_dispatch(schedule, period, task_id=f"{schedule}@run", now=period)
        store.run_start(schedule, period, task_id=f"{schedule}@run", now=period + 1)
        store.run_finish(schedule, period, status=OK, now=period + 5)
    IdempotencyKey.objects.create(key=f"{TASK_NAME}:globex:charge:1", state="completed")
    DependencyState.objects.create(dependency="payments-api")
    return records


PERMISSIONS = [
    "view_deadletter",
    "replay_deadletter",
    "discard_deadletter",
    "resolve_deadletter",
    "view_scheduledrun",
    "view_concurrencyslot",
    "view_outboxmessage",
    "view_idempotencykey",
    "view_dependencystate",
]


def staff_user(name: str, *extra: Permission) -> User:
    user = User.objects.create_user(name, is_staff=True)  # no password to hash: force_login
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="guardrails", codename__in=PERMISSIONS)
    )
    user.user_permissions.add(*extra)
    return User.objects.get(pk=user.pk)  # no cached permissions


def scoped_by(settings: LazySettings, value: Any) -> None:
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, "admin_tenants": value}


@pytest.fixture(params=["callable", "permissions"])
def staff(request: pytest.FixtureRequest, settings: LazySettings) -> dict[str, User]:
    """The staff of acme and of globex, scoped by the callable above or by a permission per tenant."""
    if request.param == "callable":
        scoped_by(settings, f"{__name__}.tenants_of")
        return {tenant: staff_user(f"{tenant}-staff") for tenant in ("acme", "globex")}
    scoped_by(settings, "permissions")
    return {tenant: staff_user(f"{tenant}-staff", tenant_permission(tenant)) for tenant in ("acme", "globex")}


@pytest.fixture
def acme_staff(settings: LazySettings) -> User:
    """Acme's staff, scoped by the callable (the actions and replays: how a user is scoped does not matter
    there, the tests above show both ways give the same scope)."""
    scoped_by(settings, f"{__name__}.tenants_of")
    return staff_user("acme-staff")


def client_of(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def task_ids(records: list[DeadLetter]) -> set[str]:
    return {record.task_id for record in records}


def listed(client: Client, url: str = DEAD_LETTERS, **query: str) -> set[str]:
    page = client.get(reverse(url), query)
    assert page.status_code == 200
    return {row.task_id for row in page.context["cl"].result_list}


def value_choices(client: Client, url: str = DEAD_LETTERS) -> dict[str, list[Any]]:
    """The choices of each filter by a column's values, on the change list."""
    page = client.get(reverse(url))
    return {
        spec.field_path: list(spec.lookup_choices)
        for spec in page.context["cl"].filter_specs
        if isinstance(getattr(spec, "lookup_choices", None), list)
    }


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def test_each_user_sees_only_their_tenant_in_lists_details_and_filter_choices(
    world: dict[str, list[DeadLetter]], staff: dict[str, User]
) -> None:
    for tenant, user in staff.items():
        client = client_of(user)
        # Given the staff of one tenant, When they open the dead letters, Then they see their tenant's only
        assert listed(client) == task_ids(world[tenant])
        page = client.get(reverse(DEAD_LETTERS))
        assert not any(name.encode() in page.content for name in others(tenant))
        # and the filters offer their tenant, reasons, owners and tasks only
        assert value_choices(client) == {
            "reason": [REASONS[tenant]],
            "task_name": sorted([TASK_NAME, f"tests.proj.tasks.{tenant}_report"]),
            "owner": [OWNERS[tenant]],
            "tenant": [tenant],
        }
        # When they ask for another tenant's records by URL or by search: Then nothing is listed
        other = world["initech"][0]
        assert listed(client, tenant="initech") == set()
        assert listed(client, q=other.task_id) == set()
        assert listed(client, status__exact="open", reason=REASONS["initech"]) == set()
        # Their own record's page opens; another tenant's, or its history, is a 404, as an id that does not exist
        mine = world[tenant][0]
        assert client.get(reverse("admin:guardrails_deadletter_change", args=[mine.pk])).status_code == 200
        missing = DeadLetter.objects.order_by("-pk").first().pk + 1000  # type: ignore[union-attr]
        for pk in (other.pk, world[""][0].pk, missing):
            for view in ("change", "history", "replay", "edit_and_replay"):
                assert client.get(reverse(f"admin:guardrails_deadletter_{view}", args=[pk])).status_code == 404


def test_actions_and_their_confirmation_pages_refuse_ids_of_another_tenant(
    world: dict[str, list[DeadLetter]], acme_staff: User, broker: str, queue_name: str
) -> None:
    acme, globex = world["acme"], world["globex"]
    client = client_of(acme_staff)
    # Given acme's staff, When they fix their record to run as globex (its arguments would run as globex)
    edit = reverse("admin:guardrails_deadletter_edit_and_replay", args=[acme[1].pk])
    page = client.post(edit, {"tenant": "globex", "args": '[2, "sink-acme", ["ok"]]', "kwargs": "{}"})
    # Then it is refused, saying why, and nothing is published
    why = "tenant 'globex' is not one you may see (admin_tenants)"
    assert messages_of(page) == [f"1 dead letter(s) not replayed ({acme[1].pk}): {why}"]
    assert DeadLetter.objects.get(pk=acme[1].pk).status == "open" and waiting_messages(broker, queue_name) == 0
    for theirs, action, verb, status in (
        (acme[0], "discard_selected", "discard", "discarded"),
        (acme[2], "resolve_selected", "mark these dead letters resolved", "resolved"),
    ):
        # When they post an action on their record and, by hand, on a globex record
        form = {"action": action, "_selected_action": [theirs.pk, globex[0].pk], "select_across": "0", "index": "0"}
        confirm = client.post(reverse(DEAD_LETTERS), form)
        # Then the confirmation page names theirs only
        assert verb.encode() in confirm.content and list(confirm.context["queryset"]) == [theirs]
        assert confirm.context["count"] == 1 and globex[0].task_id.encode() not in confirm.content
        # And confirmed, only theirs changes, with its LogEntry
        done = client.post(reverse(DEAD_LETTERS), {**form, "post": "yes"}, follow=True)
        assert messages_of(done) == [f"{status.capitalize()} 1 dead letter(s)."]
        assert DeadLetter.objects.get(pk=theirs.pk).status == status
    # When they confirm an action on another tenant's id only: Then nothing is changed
    form = {"action": "discard_selected", "_selected_action": [globex[1].pk], "select_across": "0", "index": "0"}
    done = client.post(reverse(DEAD_LETTERS), {**form, "post": "yes"}, follow=True)
    assert messages_of(done) == ["Discarded 0 dead letter(s)."]
    # When "select all" replays what their list of open records shows, with a globex id posted too
    form = {"action": "replay_selected", "select_across": "1", "index": "0", "_selected_action": [globex[0].pk]}
    done = client.post(f"{reverse(DEAD_LETTERS)}?status__exact=open", {**form, "post": "yes"}, follow=True)
    # Then their open charge record is replayed (published once), the other tenants' records are untouched
    assert messages_of(done) == ["Replayed 1 dead letter(s)."]
    assert waiting_messages(broker, queue_name) == 1
    assert DeadLetter.objects.get(pk=acme[1].pk).status == "replayed"
    for tenant in ("globex", "initech", ""):
        assert set(DeadLetter.objects.filter(tenant=tenant).values_list("status", "handled_by")) == {("open", "")}
    assert not LogEntry.objects.exclude(object_id__in=[str(r.pk) for r in DeadLetter.objects.filter(tenant="acme")])
    # When the one-record replay pages of a globex record are posted to by hand: Then 404, nothing published
    for view, body in (("replay", {"post": "yes"}), ("edit_and_replay", {"tenant": "", "args": "[]", "kwargs": "{}"})):
        url = reverse(f"admin:guardrails_deadletter_{view}", args=[globex[0].pk])
        assert client.post(url, body).status_code == 404
    assert waiting_messages(broker, queue_name) == 1
    assert DeadLetter.objects.get(pk=globex[0].pk).status == "open"


def test_the_replay_and_close_functions_refuse_what_the_user_may_not_see(
    world: dict[str, list[DeadLetter]], acme_staff: User, broker: str, queue_name: str
) -> None:
    mine, theirs = world["acme"][0], world["globex"][0]
    missing = DeadLetter.objects.order_by("-pk").first().pk + 1000  # type: ignore[union-attr]
    # Given acme's staff, When they replay their record and a globex one by id
    result = replay_dead_letters([mine.pk, theirs.pk], user=acme_staff)
    # Then theirs is left out, as an id without a record is, untouched; only acme's is published
    assert ([pk for pk, _ in result.replayed], result.skipped) == ([mine.pk], [])
    assert waiting_messages(broker, queue_name) == 1
    assert DeadLetter.objects.get(pk=theirs.pk).status == "open"
    # When they replay a globex record with a fix, Then it is refused as a record that does not exist is
    assert replay_with_changes(theirs.pk, user=acme_staff, args=[1]).skipped == [(theirs.pk, "no such dead letter")]
    assert replay_with_changes(missing, user=acme_staff, args=[1]).skipped == [(missing, "no such dead letter")]
    # When they replay their own as another tenant, Then that is refused
    second = world["acme"][1]
    refused = replay_dead_letters([second.pk], user=acme_staff, tenant="globex")
    assert refused.replayed == [] and refused.skipped == [
        (second.pk, "tenant 'globex' is not one you may see (admin_tenants)")
    ]
    assert waiting_messages(broker, queue_name) == 1
    # When they discard their record and a globex one, Then only theirs is discarded
    both = DeadLetter.objects.filter(pk__in=[second.pk, theirs.pk])
    assert close_dead_letters(both, DeadLetter.Status.DISCARDED, user=acme_staff) == 1
    assert DeadLetter.objects.get(pk=theirs.pk).status == "open"
    # And without a user (a command), every record is in reach, as before
    assert [pk for pk, _ in replay_dead_letters([theirs.pk]).replayed] == [theirs.pk]


def test_overview_dashboard_ledger_health_and_other_tables_show_their_tenant_only(
    world: dict[str, list[DeadLetter]], staff: dict[str, User]
) -> None:
    for tenant, user in staff.items():
        client = client_of(user)
        # Given one tenant's staff, When they open the overview: Then it counts their records only
        overview = client.get(reverse("admin:guardrails_deadletter_overview"))
        summary = overview.context["overview"]
        assert summary.open_count == 3 and summary.last_day_count == 3
        assert [(group.value, group.count) for group in summary.by_reason] == [(REASONS[tenant], 3)]
        assert [(group.value, group.count) for group in summary.by_owner] == [(OWNERS[tenant], 3)]
        # The dashboard: their dead letters per hour and by owner, their schedules; the figures of every
        # tenant together are not shown
        dashboard = client.get(reverse("admin:guardrails_dashboard_changelist"))
        context = dashboard.context
        assert context["hours"].total == 3 and context["hours"].reasons == [REASONS[tenant]]
        assert context["owners"] == {OWNERS[tenant]: 3}
        assert [line.schedule for line in context["status"].schedules] == [f"{tenant} nightly"]
        assert context["status"].queues == [] and context["status"].errors["queues"] == HIDDEN
        assert context["status"].dependencies == [] and context["activity"].error == HIDDEN
        # The run ledger: their schedule's records, their schedule in its filter; another schedule's is a 404
        assert listed(client, LEDGER) == {f"{tenant} nightly@run"}
        assert value_choices(client, LEDGER) == {"schedule": [f"{tenant} nightly"]}
        assert listed(client, LEDGER, schedule="initech sync") == set() and listed(client, LEDGER, q="gone") == set()
        other = ScheduledRun.objects.get(schedule="initech sync")
        assert client.get(reverse("admin:guardrails_scheduledrun_change", args=[other.pk])).status_code == 404
        # The schedule-health page: their schedule only
        health = client.get(reverse("admin:guardrails_scheduledrun_health"))
        assert [item.schedule for item, _ in health.context["rows"]] == [f"{tenant} nightly"]
        # Slots and outbox messages by their tenant; idempotency keys and dependencies (every tenant's
        # together): no page
        assert {row.tenant for row in client.get(reverse("admin:guardrails_concurrencyslot_changelist")).context[
            "cl"
        ].result_list} == {tenant}  # fmt: skip
        outbox = client.get(reverse("admin:guardrails_outboxmessage_changelist")).context["cl"].result_list
        assert {row.tenant for row in outbox} == {tenant}
        for model in ("idempotencykey", "dependencystate"):
            assert client.get(reverse(f"admin:guardrails_{model}_changelist")).status_code == 403
        index = client.get(reverse("admin:index")).content
        assert b"Idempotency keys" not in index and b"Dependency states" not in index
        for page in (overview, dashboard, health):
            assert not any(name.encode() in page.content for name in others(tenant)), page.request["PATH_INFO"]


def test_unset_every_user_sees_every_tenant_as_before(world: dict[str, list[DeadLetter]], app: Celery) -> None:
    # Given no admin_tenants, and the staff users of two tenants (the permissions mode's grants, unused)
    for user in (staff_user("acme-staff", tenant_permission("acme")), staff_user("globex-staff")):
        client = client_of(user)
        # When they open the dead letters, Then every record of every tenant is listed, every value in the filters
        assert listed(client) == {record.task_id for records in world.values() for record in records}
        assert value_choices(client)["tenant"] == ["", "acme", "globex", "initech"]
        # and a record of any tenant opens; an id that does not exist redirects, as Django does
        assert (
            client.get(reverse("admin:guardrails_deadletter_change", args=[world["initech"][0].pk])).status_code == 200
        )
        missing = DeadLetter.objects.order_by("-pk").first().pk + 1000  # type: ignore[union-attr]
        assert client.get(reverse("admin:guardrails_deadletter_change", args=[missing])).status_code == 302
        # and the dashboard, the ledger, the health page and the internal tables show everything
        context = client.get(reverse("admin:guardrails_dashboard_changelist")).context
        assert context["owners"] == {owner: 3 for owner in OWNERS.values()}
        assert "queues" not in context["status"].errors and context["activity"].error != HIDDEN
        assert len(listed(client, LEDGER)) == 5
        rows = client.get(reverse("admin:guardrails_scheduledrun_health")).context["rows"]
        assert [item.schedule for item, _ in rows] == [*sorted(SCHEDULE_TENANTS), "gone"]
        assert client.get(reverse("admin:guardrails_idempotencykey_changelist")).status_code == 200
        assert visible_tenants(user) is ALL_TENANTS


def test_a_callable_that_fails_or_answers_wrong_shows_nothing_and_logs_the_user(
    world: dict[str, list[DeadLetter]],
    settings: LazySettings,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scoped_by(settings, f"{__name__}.tenants_of")
    user = staff_user("acme-staff")
    for answer in (RuntimeError("directory down"), None, "acme", ["acme", 7]):
        # Given a callable that raises for a user, or answers None, a bare string or a non-string id
        monkeypatch.setitem(STAFF, "acme-staff", answer)
        caplog.clear()
        client = client_of(user)
        # When the user opens the admin, Then they see nothing, never everything
        assert listed(client) == set(), answer
        assert client.get(reverse("admin:guardrails_deadletter_change", args=[world["acme"][0].pk])).status_code == 404
        assert client.get(reverse("admin:guardrails_dashboard_changelist")).context["owners"] == {}
        assert listed(client, LEDGER) == set()
        # And the error is logged with the user's id
        logged = [r for r in caplog.records if r.levelno == logging.ERROR and "admin_tenants" in r.getMessage()]
        assert logged and f"user {user.pk}" in logged[0].getMessage()
    # Given a callable that says every tenant, or names the records without one (""), Then so it is
    monkeypatch.setitem(STAFF, "acme-staff", ALL_TENANTS)
    assert len(listed(client_of(user))) == 12
    monkeypatch.setitem(STAFF, "acme-staff", ("", "initech"))
    assert listed(client_of(user)) == task_ids(world[""]) | task_ids(world["initech"])
    # Given a superuser: the callable is asked for them too, and its answer is final
    root = User.objects.create_superuser("root", "root@example.com", None)
    assert len(listed(client_of(root))) == 12
    monkeypatch.setitem(STAFF, "root", ["globex"])
    assert listed(client_of(root)) == task_ids(world["globex"])
    # Given admin_tenants as a function object, Then it is used as its dotted path is
    scoped_by(settings, lambda user: ["initech"])
    assert listed(client_of(staff_user("someone"))) == task_ids(world["initech"])
    # Given a path that does not import, When a staff user opens the admin, Then they see nothing
    scoped_by(settings, "tests.nowhere.tenants")
    assert listed(client_of(staff_user("someone-else"))) == set()


def test_permissions_map_tenants_to_codenames_and_view_all_tenants_sees_all(
    world: dict[str, list[DeadLetter]], settings: LazySettings
) -> None:
    scoped_by(settings, "permissions")
    # A tenant's permission is its id under a prefix, for ids that fit a codename (100 characters)
    assert tenant_codename("acme") == "view_tenant_acme"
    assert len(tenant_codename("t" * TENANT_PERMISSION_MAX)) == 100
    for tenant in ("", "t" * (TENANT_PERMISSION_MAX + 1)):
        with pytest.raises(ContextError, match="view_all_tenants"):
            tenant_codename(tenant)
    # Given a tenant id with every separator a tenant id may hold, and a user with its permission
    odd = "org.acme:eu@x+y-z_1"
    record = letter("", 9)
    DeadLetter.objects.filter(pk=record.pk).update(tenant=odd)
    user = staff_user("odd-staff", tenant_permission(odd))
    assert tenant_permission(odd).codename == f"view_tenant_{odd}"  # made once
    # Then they see that tenant's record only
    assert listed(client_of(user)) == {record.task_id}
    # Given guardrails.view_all_tenants (made by migrate), Then every record, those without a tenant too
    everything = Permission.objects.get(content_type__app_label="guardrails", codename=ALL_CODENAME)
    assert len(listed(client_of(staff_user("ops", everything)))) == 13
    # A superuser has every permission; a staff user with none sees nothing
    assert len(listed(client_of(User.objects.create_superuser("root", "root@example.com", None)))) == 13
    assert listed(client_of(staff_user("nobody"))) == set()


def test_the_option_is_checked_at_start_up_and_by_manage_py_check(settings: LazySettings) -> None:
    # A bad value stops a worker at start-up (the app config is validated), naming the key
    for bad in (42, "permission", ["acme"]):
        with pytest.raises(ConfigurationError, match="admin_tenants"):
            validate({"admin_tenants": bad})
        worker_app = Celery("scoping-check", set_as_current=False)
        worker_app.conf.guardrails = {"admin_tenants": bad}
        with pytest.raises(ConfigurationError, match="admin_tenants"):
            app_settings(worker_app)
    with pytest.raises(ConfigurationError, match="cannot be set in task scope"):
        validate({"admin_tenants": "permissions"}, scope=TASK)
    for good in (None, "permissions", f"{__name__}.tenants_of", tenants_of):
        assert validate({"admin_tenants": good}) == {"admin_tenants": good}
    # manage.py check: a bad value is E001, a path that does not import or is not callable E010
    scoped_by(settings, "permission")
    assert [e.id for e in check_settings()] == ["guardrails.E001"] and check_admin_tenants() == []
    for path, problem in (("tests.nowhere.tenants", "cannot import"), (f"{__name__}.NOT_CALLABLE", "not callable")):
        scoped_by(settings, path)
        (error,) = check_admin_tenants()
        assert error.id == "guardrails.E010" and problem in error.msg and "admin_tenants" in error.msg
    for good in ("permissions", f"{__name__}.tenants_of", None):
        scoped_by(settings, good)
        assert check_admin_tenants() == []


def test_the_metrics_view_is_for_staff_who_see_every_tenant(staff: dict[str, User]) -> None:
    # Given the staff of acme (scoped) and a superuser (every tenant)
    root = User.objects.create_superuser("metrics-root", "root@example.com", None)
    # When each asks for the Prometheus exposition, which mixes every tenant's figures
    # Then the scoped user is refused, as the dashboard hides those figures from them; the superuser reads it
    assert client_of(staff["acme"]).get(reverse("guardrails:metrics")).status_code == 403
    assert client_of(root).get(reverse("guardrails:metrics")).status_code == 200


def test_a_setting_that_does_not_import_shows_nothing_and_is_logged_once_a_request(
    settings: LazySettings, world: dict[str, list[DeadLetter]], caplog: pytest.LogCaptureFixture
) -> None:
    # Given admin_tenants naming a callable that does not exist
    scoped_by(settings, "tests.django_app.no_such_module.tenants_of")
    user = staff_user("acme-staff")
    # When the user opens the dead letters
    with caplog.at_level(logging.ERROR, logger="django_celery_guardrails.scoping"):
        page = client_of(user).get(reverse("admin:guardrails_deadletter_changelist"))
    # Then they see none, and the error is logged once for the request, not once per query of the page
    assert page.status_code == 200 and list(page.context["cl"].result_list) == []
    assert [r.getMessage() for r in caplog.records].count(
        f"admin_tenants is set wrong: user {user.pk} sees no tenant (manage.py check says why)"
    ) == 1
