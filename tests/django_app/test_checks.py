"""System checks name the bad key of CELERY_GUARDRAILS and the missing middleware; every audit finding code has
its check id."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.checks import run_checks
from django.test import override_settings

from celery_guardrails import GuardedTask
from celery_guardrails.operations import audit
from django_celery_guardrails import checks
from django_celery_guardrails.checks import AUDIT_IDS


@pytest.fixture(autouse=True)
def project_app() -> Iterator[Any]:
    """The example project's Celery app, current as in its own processes (the checks read the current app;
    an earlier test in the same process may have left another one current)."""
    from celery import current_app

    from example_project.celery_app import app

    before = current_app._get_current_object()
    app.set_current()
    yield app
    before.set_current()


def ids() -> list[str]:
    return [message.id for message in run_checks() if message.id and message.id.startswith("guardrails.")]


def test_example_project_settings_pass() -> None:
    assert ids() == []


@override_settings(CELERY_GUARDRAILS={"tenant_reslover": "x.y"})
def test_unknown_key_is_an_error_naming_it() -> None:
    (error,) = [m for m in run_checks() if m.id == "guardrails.E001"]
    assert "'tenant_reslover'" in error.msg and "did you mean 'tenant_resolver'" in error.msg


def test_missing_middleware_is_a_warning(settings) -> None:  # type: ignore[no-untyped-def]
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if "guardrails" not in m]
    assert ids() == ["guardrails.W001"]


def test_no_seal_keys_is_a_warning(settings) -> None:  # type: ignore[no-untyped-def]
    # Given settings without seal_keys
    settings.CELERY_GUARDRAILS = {k: v for k, v in settings.CELERY_GUARDRAILS.items() if k != "seal_keys"}
    # Then the checks warn that redacted records cannot be replayed
    assert ids() == ["guardrails.W002"]


def test_every_audit_code_has_its_system_check_id_and_is_in_the_table() -> None:
    # Given every finding code the audit defines (its module docstring's table)
    codes = re.findall(r"^    (GA\d{3}) (?:error|warning|info) ", audit.__doc__ or "", flags=re.MULTILINE)
    assert len(codes) == len(set(codes)) and {code[2] for code in codes} == set("012345678")
    # Then each has its id by the rule, guardrails.W1 + axis digit + number (GA0xx -> W10x, GA8xx -> W18x), but
    # GA405, which W002 says already, GA607, which the plain check's I001 says, and GA608 (an opt-out, a choice)
    # (and GA106, which W003 says, and GA006, which W006 says)
    quiet = ("GA006", "GA106", "GA405", "GA607", "GA608")
    expected = {code: None if code in quiet else f"guardrails.W1{code[2]}{code[4]}" for code in codes}
    assert {code: AUDIT_IDS[code] for code in codes} == expected
    # And the checks' docstring table lists every code with that id
    table = dict(re.findall(r"(GA\d{3}) (W1\d\d|-)", checks.__doc__ or ""))
    assert table == {code: (found or "-").removeprefix("guardrails.") for code, found in expected.items()}


def test_the_deploy_check_grades_the_project_s_source(settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Given a BASE_DIR whose view publishes a task inside a transaction
    (tmp_path / "proj" / "shop").mkdir(parents=True)
    (tmp_path / "proj" / "shop" / "views.py").write_text(
        "from django.db import transaction\n\n\n"
        "def checkout(request):\n    with transaction.atomic():\n        charge.delay(1)\n"
    )
    settings.BASE_DIR = tmp_path / "proj"
    # When the deployment checks run
    messages = [m for m in run_checks(include_deployment_checks=True) if m.id == "guardrails.W102"]
    # Then the file is a warning, with the fix as its hint
    assert [
        (m.obj, m.msg.startswith("publishes a task inside a database transaction, line 6 (checkout)")) for m in messages
    ] == [("shop/views.py", True)]
    assert "delay_on_commit" in (messages[0].hint or "")


def settings_with(settings: Any, **changes: Any) -> None:
    settings.CELERY_GUARDRAILS = {**settings.CELERY_GUARDRAILS, **changes}


def test_an_empty_redact_keys_is_the_audit_s_rule_in_its_words(settings: Any, tmp_path: Path) -> None:
    from celery import Celery

    for redact_keys in ([], ["token"]):
        # Given settings with an empty redact_keys, and the same with one fragment; and an app configured alike
        settings_with(settings, redact_keys=redact_keys)
        app = Celery("redaction", set_as_current=False, broker="redis://127.0.0.1:6379/15")
        app.conf.guardrails = {"store": "redis://127.0.0.1:6379/15", "redact_keys": redact_keys}
        # When manage.py check runs, and the app is audited
        said = [(m.id, m.msg) for m in run_checks() if "redact_keys" in m.msg]
        found = [f.message for f in audit.audit(app, source=tmp_path).findings if f.code == "GA106"]
        # Then the empty one is W003 in the words of the audit's GA106 (which check --deploy does not repeat),
        # and the other is neither
        assert said == [("guardrails.W003", message) for message in found]
        assert len(found) == (0 if redact_keys else 1)


def test_seal_keys_given_as_a_set_or_a_dict_are_an_error_that_shows_no_piece_of_them(settings: Any) -> None:
    first, second = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    pieces = {key[i : i + 6] for key in (first, second) for i in range(len(key) - 5)}
    for bad in ({first, second}, {"primary": first, "old": second}, {first: second}):
        # Given seal_keys as a set or a dict
        settings_with(settings, seal_keys=bad)
        # When manage.py check runs
        (error,) = [m for m in run_checks() if m.id == "guardrails.E001"]
        # Then it names the setting, and shows no piece of a key
        assert error.msg.startswith("celery-guardrails setting 'seal_keys': must be a list of Fernet keys")
        assert not any(piece in error.msg for piece in pieces), error.msg
    # And bytes, as Fernet.generate_key() returns them, are taken
    settings_with(settings, seal_keys=[first.encode()])
    assert ids() == []


@pytest.mark.parametrize(
    ("changes", "text"),
    [
        ({"alert_channels": ["log", "pager"]}, "'alert_channels': unknown channel 'pager'; known: log, mail, webhook"),
        ({"dead_letter_retention": float("nan")}, "'dead_letter_retention': must be a positive finite number"),
        ({"alert_throttle": float("inf")}, "'alert_throttle': must be a positive finite number"),
        ({"run_alert_throttle": float("nan")}, "'run_alert_throttle': must be a finite number"),
        ({"owners": {"shop.*": "the shop team"}}, "'owners': pattern 'shop.*': the owner must be a name of 1 to 100"),
        ({"redact_keys": "token"}, "'redact_keys': must be a list of key-name fragments"),
        ({"dead_letter_sinks": []}, "'dead_letter_sinks': must name at least one sink"),
    ],
)
def test_settings_accepted_silently_before_are_errors(settings: Any, changes: dict[str, Any], text: str) -> None:
    settings_with(settings, **changes)
    (error,) = [m for m in run_checks() if m.id == "guardrails.E001"]
    assert text in error.msg


def test_an_empty_redact_keys_is_a_warning(settings: Any) -> None:
    settings_with(settings, redact_keys=[])
    assert ids() == ["guardrails.W003"]
    (warning,) = [m for m in run_checks() if m.id == "guardrails.W003"]
    assert warning.msg == "redact_keys is empty: no value is redacted by its key name in dead letters and logs"


def test_a_guarded_task_keyed_by_a_secret_is_an_error_naming_task_option_and_field(celery_app: Any) -> None:
    # Given the project's app with a task whose idempotency key template reads its API token
    @celery_app.task(
        base=GuardedTask, bind=True, shared=False, name="shop.pay_by_token", idempotency_key="p:{api_token}"
    )
    def pay(self: GuardedTask, order_id: int, api_token: str) -> None: ...

    # When manage.py check runs, Then the task is an error, as the worker would refuse it
    (error,) = [m for m in run_checks() if m.id == "guardrails.E002"]
    assert error.obj == "shop.pay_by_token"
    assert error.msg.startswith(
        "celery-guardrails setting 'idempotency_key': on task 'shop.pay_by_token': field {api_token} names "
        "'api_token', a secret (redact_keys entry 'token')"
    )


@pytest.mark.django_db
def test_plain_check_names_each_entry_and_row_watched_with_the_default_policy() -> None:
    from celery import current_app
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    # Given a settings entry of a guarded task with no policy, one of a plain task, one opted out, Celery's own
    # backend_cleanup, and django-celery-beat rows: a guarded task's with no policy, a disabled one, a one-off one
    app = current_app._get_current_object()
    task = "tests.proj.tasks.scheduled_job"

    @app.task(name="tests.checks.plain", shared=False, lazy=False)
    def plain() -> None: ...  # a plain Celery task (removed below)

    beat_schedule = app.conf.beat_schedule
    app.conf.beat_schedule = {
        **beat_schedule,
        "nightly": {"task": task, "schedule": 86400.0},
        "plain": {"task": "tests.checks.plain", "schedule": 60.0},
        "opted": {"task": task, "schedule": 60.0},
        "celery.backend_cleanup": {"task": "celery.backend_cleanup", "schedule": 86400.0},
    }
    guardrails = app.conf.guardrails
    app.conf.guardrails = {**guardrails, "schedules": {**guardrails.get("schedules", {}), "opted": None}}
    every = IntervalSchedule.objects.create(every=4, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="row every 4s", task=task, interval=every)
    PeriodicTask.objects.create(name="row disabled", task=task, interval=every, enabled=False)
    PeriodicTask.objects.create(name="row once", task=task, interval=every, one_off=True)
    try:
        # When plain `manage.py check` runs (no --deploy)
        messages = [m for m in run_checks() if m.id in ("guardrails.I001", "guardrails.W005")]
    finally:
        app.conf.beat_schedule, app.conf.guardrails = beat_schedule, guardrails
        del app.tasks["tests.checks.plain"]
    # Then one message of information names each entry and row watched with the default policy, with its grace;
    # one warning names the plain task's entry; the opted-out, Celery's own and the one-off entries are not named
    assert [(m.id, m.obj) for m in messages] == [("guardrails.I001", "schedules"), ("guardrails.W005", "schedules")]
    info, warning = messages
    assert info.msg == (
        "3 beat entries are watched with the default policy (missed when later than its grace, overlap skip, "
        "catch-up latest): beat entry 'nightly' (grace 60 s); periodic task 'row disabled' (disabled, grace 2 s); "
        "periodic task 'row every 4s' (grace 2 s)."
    )
    assert warning.msg == (
        "1 beat entry is not watched, no missed-run detection: beat entry 'plain' (its task tests.checks.plain is a "
        "plain Celery task (not a GuardedTask))."
    )


POSTGRES = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop"}


def django_store_app(**conf: Any) -> Any:
    """A Celery app (on the Django store unless ``conf`` says) with Celery's Django fixup, as a Django project's
    celery.py makes it."""
    from celery import Celery

    app = Celery("connections", set_as_current=False, fixups=["celery.fixups.django:fixup"])
    app.conf.update({"guardrails": {"store": "django"}, **conf})
    return app


@pytest.mark.parametrize(
    ("conf", "pool", "database", "found"),
    [
        # no reuse, no pool: a connection per task, whatever the worker's pool
        ({}, None, POSTGRES, "no Django pool takes the closed connection back"),
        ({}, "threads", POSTGRES, "no Django pool takes the closed connection back"),
        # Django's pool under prefork: Celery closes the pool itself after every task
        ({}, "prefork", {**POSTGRES, "OPTIONS": {"pool": True}}, "celery/celery#10554"),
        # Django's pool with threads or solo: the close hands the connection back
        ({}, "threads", {**POSTGRES, "OPTIONS": {"pool": True}}, None),
        ({}, "solo", {**POSTGRES, "OPTIONS": {"pool": True}}, None),
        # CELERY_DB_REUSE_MAX: Celery keeps them
        ({"CELERY_DB_REUSE_MAX": 1000}, "prefork", POSTGRES, None),
        # SQLite: a file, no server's connection
        ({}, "prefork", {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}, None),
    ],
)
def test_the_django_store_with_connections_closed_around_every_task_is_found_with_its_cause(
    conf: dict[str, Any], pool: str | None, database: dict[str, Any], found: str | None
) -> None:
    # Given a Django project's app on the Django store, its database and the worker's pool
    app = django_store_app(**conf)
    # When the connection rule reads them
    findings = audit.connection_rules(app, pool=pool, database=database)
    # Then it finds GA006 with the cause, or nothing where the connection is kept or cheap
    if found is None:
        assert findings == []
    else:
        (finding,) = findings
        assert (finding.code, finding.severity, finding.subject) == ("GA006", "warning", "CELERY_DB_REUSE_MAX")
        assert found in finding.message and "CELERY_DB_REUSE_MAX" in finding.fix and "pool" in finding.fix


def test_the_connection_rule_reads_nothing_on_a_redis_store_or_without_celery_s_django_fixup() -> None:
    from celery import Celery

    # Given the Redis store, or an app Celery's Django fixup does not watch (nothing closes its connections)
    on_redis = django_store_app(guardrails={"store": "redis://127.0.0.1:6379/1"})
    unwatched = Celery("plain", set_as_current=False, fixups=[])
    unwatched.conf.guardrails = {"store": "django"}
    # Then neither is a finding
    assert audit.connection_rules(on_redis, database=POSTGRES) == []
    assert audit.connection_rules(unwatched, database=POSTGRES) == []


def test_plain_check_says_w006_for_the_project_s_app_and_its_worker_pool(settings: Any, project_app: Any) -> None:
    # Given the example project on a database server (the PostgreSQL pass; the SQLite pass skips it) with its
    # CELERY_DB_REUSE_MAX taken away
    if "sqlite" in settings.DATABASES["default"]["ENGINE"]:
        pytest.skip("SQLite: a file, no server's connection (runs in the PostgreSQL pass)")
    app = project_app
    kept = app.conf.get("CELERY_DB_REUSE_MAX")
    assert kept, "the example project keeps its connections (settings.CELERY_DB_REUSE_MAX)"
    app.conf["CELERY_DB_REUSE_MAX"] = None
    try:
        # Then `manage.py check` warns, with the fix as the hint
        (warning,) = [m for m in run_checks() if m.id == "guardrails.W006"]
    finally:
        app.conf["CELERY_DB_REUSE_MAX"] = kept
    assert "(GA006)" in warning.msg and "CELERY_DB_REUSE_MAX" in (warning.hint or "")
    # And with it back, nothing
    assert "guardrails.W006" not in ids()
