"""The one lookup rule and the validation of settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_guardrails import ConfigurationError, GuardedTask
from celery_guardrails.options import OPTIONS, app_settings, resolve, validate
from tests.support.services import require
from tests.support.workers import PROJ_APP, WorkerProcess, proj_env


def make_task(app: Celery, **attributes: Any) -> GuardedTask:
    @app.task(base=GuardedTask, bind=True, name=f"t{len(app.tasks)}", **attributes)
    def task(self: GuardedTask) -> None: ...

    return task  # type: ignore[no-any-return]


def keyed_task(app: Celery, **attributes: Any) -> GuardedTask:
    # shared=False: a shared task would join every app made later, and stop their workers from starting
    @app.task(base=GuardedTask, bind=True, shared=False, name=f"shop.pay{len(app.tasks)}", **attributes)
    def pay(self: GuardedTask, order_id: int, api_token: str, order: Any = None, creds: Any = None) -> None: ...

    return pay  # type: ignore[no-any-return]


def test_lookup_order_call_then_task_then_app_then_default() -> None:
    app = Celery("lookup", set_as_current=False)
    plain, strict = make_task(app), make_task(app, tenant_required=True)
    # default
    assert resolve(plain, "tenant_required", {}) is False
    # app config beats the default
    app.conf.guardrails = {"tenant_required": True}
    assert resolve(plain, "tenant_required", {}) is True
    # the task attribute beats the app config
    app.conf.guardrails = {"tenant_required": False}
    assert resolve(strict, "tenant_required", {}) is True
    # the per-call option beats everything
    assert resolve(strict, "tenant_required", {"tenant_required": False}) is False


def test_every_option_has_a_documented_default() -> None:
    for option in OPTIONS.values():
        assert option.doc and option.scopes, option.name
        if option.default is not None:
            option.check(option.default)


@pytest.mark.parametrize(
    ("raw", "key", "text"),
    [
        ({"tenant_requried": True}, "tenant_requried", "did you mean 'tenant_required'"),
        ({"tenant_required": "yes"}, "tenant_required", "must be True or False"),
        ({"tenant_resolver": 42}, "tenant_resolver", "dotted path"),
        ({"request_id_headers": "X-Request-ID"}, "request_id_headers", "list of HTTP header names"),
        ({"zzz": 1}, "zzz", "known keys"),
    ],
)
def test_bad_settings_name_the_key(raw: dict[str, Any], key: str, text: str) -> None:
    with pytest.raises(ConfigurationError, match=text) as caught:
        validate(raw)
    assert caught.value.key == key
    assert repr(key) in str(caught.value)


def test_app_only_option_is_refused_per_call_and_on_tasks() -> None:
    with pytest.raises(ConfigurationError, match="cannot be set in call scope"):
        validate({"tenant_resolver": "a.b"}, scope="call")
    app = Celery("scopes", set_as_current=False)
    task = make_task(app)
    with pytest.raises(ConfigurationError, match="cannot be set in call scope"):
        task.apply_async(tenant_resolver="a.b")


def test_settings_are_revalidated_when_replaced() -> None:
    app = Celery("cache", set_as_current=False)
    app.conf.guardrails = {"tenant_required": True}
    assert app_settings(app) == {"tenant_required": True}
    app.conf.guardrails = {"tenant_required": "no"}
    with pytest.raises(ConfigurationError):
        app_settings(app)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"GUARDRAILS_TEST_GUARDRAILS": json.dumps({"tenant_requried": True})},
            "setting 'tenant_requried': unknown key; did you mean 'tenant_required'?",
        ),
        (
            {"GUARDRAILS_TEST_GUARDRAILS": json.dumps({"tenant_required": 1})},
            "setting 'tenant_required': must be True or False",
        ),
        (
            {"GUARDRAILS_TEST_GUARDRAILS": json.dumps({"schedules": {"nightly": {"timezone": "Mars/Olympus"}}})},
            "setting 'schedules': entry 'nightly', timezone: unknown time zone 'Mars/Olympus'",
        ),
        (
            {
                "GUARDRAILS_TEST_GUARDRAILS": json.dumps({"schedules": {"nightly": {"grace": 30}}}),
                "GUARDRAILS_TEST_BEAT": json.dumps({"hourly": {"task": "tests.proj.tasks.observe", "schedule": 60}}),
            },
            "setting 'schedules': policy for 'nightly', but there is no such beat entry or PeriodicTask "
            "(known: hourly)",
        ),
        (
            {
                "GUARDRAILS_TEST_GUARDRAILS": json.dumps({"schedules": {"nightly": {"grace": 30}}}),
                "GUARDRAILS_TEST_BEAT": json.dumps(
                    {"nightly": {"task": "tests.proj.tasks.observe", "schedule": "0 25 * * *"}}
                ),
            },
            "setting 'schedules': beat entry 'nightly': bad crontab string '0 25 * * *': hour field '25'",
        ),
        (
            {
                "GUARDRAILS_TEST_GUARDRAILS": json.dumps({"schedules": {"nightly": {}}}),
                "GUARDRAILS_TEST_BEAT": json.dumps({"nightly": {"task": "tests.proj.tasks.plain_add", "schedule": 60}}),
            },
            "setting 'schedules': beat entry 'nightly': task 'tests.proj.tasks.plain_add' is not a GuardedTask",
        ),
        (
            {"GUARDRAILS_TEST_GUARDRAILS": json.dumps({"backoff_random": "random.randum"})},
            "setting 'backoff_random': cannot import 'random.randum'",
        ),
        (
            {"GUARDRAILS_TEST_GUARDRAILS": json.dumps({"clock": "celery_guardrails.clocks.file_clock"})},
            "setting 'clock': cannot import 'celery_guardrails.clocks.file_clock'",
        ),
    ],
)
def test_worker_refuses_to_start_on_a_bad_setting(
    env: dict[str, str], expected: str, tmp_path: Path, queue_name: str
) -> None:
    # Given a worker whose app config has a typo / a wrong type
    require("redis")
    worker = WorkerProcess(
        app=PROJ_APP,
        queue=queue_name,
        log_path=tmp_path / "worker.log",
        env=proj_env(queue=queue_name, **env),
    )
    # When it starts, Then it exits with an error naming the key, before consuming anything
    with pytest.raises(RuntimeError, match="exited with 1"):
        worker.start()
    assert expected in worker.log
    assert " ready." not in worker.log


def test_worker_start_warns_about_tasks_without_an_owner_and_tasks_retried_unsafely(
    tmp_path: Path, queue_name: str
) -> None:
    require("redis")
    with WorkerProcess(
        app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=proj_env(queue=queue_name)
    ) as worker:
        pass
    (line,) = [text for text in worker.log.splitlines() if "can dead-letter with no owner" in text]
    assert "tests.proj.tasks.observe" in line and "tests.proj.django_tasks" not in line
    # And the retry rules are the audit's: retry_unsafe is its zero-rule error GA301
    (unsafe,) = [text for text in worker.log.splitlines() if "GA301 tests.proj.tasks.behave_retry_unsafe:" in text]
    assert "ERROR" in unsafe and "retry_unsafe=True: run again after failures that may have acted" in unsafe


# --- values accepted silently before (issue 28) -------------------------------------------------------------


def numeric_options() -> list[str]:
    """Every option (and schedule policy key) that takes a number: its check takes 1."""
    from celery_guardrails.scheduling.policy import POLICY_CHECKS

    found = []
    for name, option in OPTIONS.items():
        try:
            option.check(1)
        except (TypeError, ValueError):
            continue
        found.append(name)
    for name, check in POLICY_CHECKS.items():
        try:
            check(1)
        except (TypeError, ValueError):
            continue
        if name not in ("since",):
            found.append(f"schedules.{name}")
    return found


def test_nan_and_infinity_are_refused_by_every_numeric_option() -> None:
    names = numeric_options()
    # (the shared validators: seconds, seconds or off, ratio, counts, ports, bytes, buckets, versions)
    assert {"dead_letter_retention", "alert_throttle", "run_alert_throttle", "retry_budget_ratio"} <= set(names)
    assert {"schedules.grace", "schedules.max_runtime", "max_attempts", "metrics_port"} <= set(names)
    for name in names:
        for bad in (float("nan"), float("inf"), -float("inf"), 10**400):
            raw: dict[str, Any] = {name: bad}
            if name.startswith("schedules."):
                raw = {"schedules": {"nightly": {name.removeprefix("schedules."): bad}}}
            with pytest.raises(ConfigurationError) as caught:
                validate(raw)
            assert caught.value.key == name.partition(".")[0], (name, bad)


def test_durations_stop_at_a_hundred_years() -> None:
    assert validate({"dead_letter_retention": 100 * 365 * 24 * 3600})["dead_letter_retention"] == 3_153_600_000.0
    with pytest.raises(ConfigurationError, match="at most 100 years"):
        validate({"dead_letter_retention": 1e300})


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ({"alert_channels": ["log", "pager"]}, "unknown channel 'pager'; known: log, mail, webhook"),
        ({"alert_channels": "log"}, "must be a list of channels (known: log, mail, webhook)"),
        ({"redact_keys": "password"}, "must be a list of key-name fragments"),
        ({"redact_keys": ["password", ""]}, "fragments are non-empty strings"),
        ({"redact_keys": ["password", None]}, "fragments are non-empty strings"),
        ({"owners": {"payments.*": "pay ments"}}, "pattern 'payments.*': the owner must be a name of 1 to 100"),
        ({"owners": {"payments.*": "p" * 101}}, "the owner must be a name of 1 to 100"),
        ({"owners": {"": "payments"}}, "task-name patterns are non-empty strings"),
        ({"dead_letter_sinks": []}, "must name at least one sink"),
        ({"dead_letter_sinks": {"django": 1}}, "must be a list of sinks"),
        ({"owner_emails": {"payments": ["not an address"]}}, "owner 'payments': must be a mail address"),
        ({"owner_emails": {"pay ments": ["a@example.com"]}}, "the owner must be a name"),
        ({"owner_emails": ["a@example.com"]}, "must map owner names to lists of mail addresses"),
        ({"alert_webhooks": {"url": 1}}, "must be a list of http:// or https:// URLs"),
        ({"alert_webhooks": ["ftp://hooks.example.com/x"]}, "webhook 1 is not an http:// or https:// URL"),
        ({"sensitive_keys": ["email", None]}, "names are strings"),
        ({"sensitive_keys": {"email": True}}, "must be a list of argument or key names"),
        ({"request_id_headers": ["X-Request-ID", "X Bad"]}, "list of HTTP header names"),
        ({"request_id_headers": [""]}, "list of HTTP header names"),
        ({"metrics_token": " " + "t" * 20}, "no spaces around it"),
        ({"transient_errors": ["no.such.Error"]}, "cannot import 'no.such.Error'"),
    ],
)
def test_values_accepted_silently_before_are_errors_naming_the_key(raw: dict[str, Any], text: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        validate(raw)
    assert caught.value.key == next(iter(raw))
    assert text in str(caught.value)
    assert str(caught.value).count("celery-guardrails setting") == 1  # named once, by the option's key


def test_redact_keys_says_what_it_is_and_an_empty_list_is_allowed_with_a_warning() -> None:
    from celery_guardrails.options import warnings_about

    # The error speaks of redact_keys' own values, not of HTTP headers
    with pytest.raises(ConfigurationError) as caught:
        validate({"redact_keys": "token"})
    assert "HTTP header" not in str(caught.value)
    # An empty list is allowed (a deployment may redact by pattern only), and warned about, on the app and a task
    assert validate({"redact_keys": []}) == {"redact_keys": ()}
    assert warnings_about(validate({"redact_keys": []})) == [
        "redact_keys is empty: no value is redacted by its key name in dead letters and logs"
    ]
    assert warnings_about(validate({})) == []
    app = Celery("redaction", set_as_current=False)
    task = keyed_task(app, redact_keys=[])
    assert warnings_about({}, [task]) == [
        f"redact_keys is empty on task {task.name!r}: nothing of its dead letters is redacted by name"
    ]


@pytest.mark.parametrize("owner", ["payments", "team.payments:eu-1", "pay ments", "", "p" * 101, "pay/ments", "é"])
def test_owners_values_follow_the_task_level_owner_rule(owner: str) -> None:
    app = Celery("owners", set_as_current=False)
    try:
        validate_task_with(app, owner=owner)
        task_level = True
    except ConfigurationError:
        task_level = False
    try:
        validate({"owners": {"payments.*": owner}})
        app_level = True
    except ConfigurationError:
        app_level = False
    assert app_level == task_level


def validate_task_with(app: Celery, **attributes: Any) -> None:
    from celery_guardrails.options import validate_task

    validate_task(keyed_task(app, **attributes))


def test_owner_emails_take_one_address_as_one_address() -> None:
    # Before, a str was spelled out: ('p', 'a', 'y', ...)
    assert validate({"owner_emails": {"payments": "pay@example.com"}}) == {
        "owner_emails": {"payments": ("pay@example.com",)}
    }


# --- no secret in an error ----------------------------------------------------------------------------------

SECRET = "Sup3rS3cretPassw0rd"


@pytest.mark.parametrize(
    "raw",
    [
        {"store": f"redis+cluster://app:{SECRET}@h1:7000/3"},
        {"store": f"redis+cluster://app:{SECRET}@h1:7000,redis://app:{SECRET}@h2:7001"},
        {"store": f"sentinel://:{SECRET}@h1:26379/1"},
        {"store": f"sentinel://h1:26379?sentinel_password={SECRET}&db=x&master_name=m"},
        {"store": f"postgresql://app:{SECRET}@db/app"},
        {"dead_letter_sinks": ["django", f"postgresql://app:{SECRET}@db/app"]},
        {"dead_letter_sinks": [f"redis+cluster://app:{SECRET}@h1:7000/3"]},
        {"alert_webhooks": [f"hooks.slack.com/services/T0/B0/{SECRET}"]},
        {"alert_webhooks": [f"https://hooks.example.com/{SECRET}", 7]},
        {"metrics_token": SECRET[:10]},
        {"idempotency_key": SECRET.encode()},
    ],
)
def test_an_error_about_a_secret_bearing_setting_names_the_key_and_place_only(raw: dict[str, Any]) -> None:
    scope = "call" if "idempotency_key" in raw else "app"
    with pytest.raises(ConfigurationError) as caught:
        validate(raw, scope=scope)
    message = str(caught.value)
    assert message.startswith(f"celery-guardrails setting {next(iter(raw))!r}: ")
    assert not any(SECRET[i : i + 6] in message for i in range(len(SECRET) - 5)), message


def test_a_bad_per_call_option_is_logged_without_its_value(caplog: pytest.LogCaptureFixture) -> None:
    from celery_guardrails.options import resolve

    app = Celery("per-call", set_as_current=False)
    task = make_task(app)
    with caplog.at_level("WARNING", logger="celery_guardrails.options"):
        assert resolve(task, "idempotency_key", {"idempotency_key": SECRET.encode()}) is None
    assert "idempotency_key" in caplog.text and SECRET[:6] not in caplog.text


def test_a_valid_redis_url_with_credentials_is_kept_whole() -> None:
    url = f"redis://app:{SECRET}@127.0.0.1:6379/1"
    assert validate({"store": url, "dead_letter_sinks": ["redis", url]}) == {
        "store": url,
        "dead_letter_sinks": ["redis", url],
    }


# --- key templates naming a secret ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "template", "field", "part", "entry"),
    [
        ("idempotency_key", "pay:{api_token}", "api_token", "api_token", "redact_keys entry 'token'"),
        ("idempotency_key", "pay:{order_id}:{order.api_token}", "order.api_token", "api_token", "'token'"),
        ("concurrency_key", "acct:{creds[secret]}", "creds[secret]", "secret", "redact_keys entry 'secret'"),
        ("exclusive_key", "{order_id}-{order.Card_Number}", "order.Card_Number", "Card_Number", "'card'"),
        ("ordering_key", "o:{order_id:{creds.password}}", "creds.password", "password", "'password'"),
        ("idempotency_key", "pay:{order.email}", "order.email", "email", "sensitive_keys entry 'email'"),
    ],
)
def test_a_key_template_naming_a_secret_is_refused_naming_task_option_and_field(
    option: str, template: str, field: str, part: str, entry: str
) -> None:
    from celery_guardrails.options import validate_task

    # Given an app that counts e-mail addresses as personal data, and a task whose key template reads a secret
    app = Celery("templates", set_as_current=False)
    app.conf.guardrails = {"sensitive_keys": ["email", "password"]}
    extra = {"concurrency_limit": 2} if option == "concurrency_key" else {}
    task = keyed_task(app, **{option: template}, **extra)
    # When its options are validated (worker start-up, manage.py check)
    with pytest.raises(ConfigurationError) as caught:
        validate_task(task)
    # Then the error names the task, the option and the field, and which setting matched
    assert caught.value.key == option
    message = str(caught.value)
    assert f"on task {task.name!r}: field {{{field}}} names {part!r}, a secret" in message
    assert entry in message


def test_key_templates_of_plain_ids_callables_and_per_call_keys_pass() -> None:
    from celery_guardrails.options import validate_task

    app = Celery("templates-ok", set_as_current=False)
    for attributes in (
        {"idempotency_key": "pay:{order_id}"},
        {"idempotency_key": "pay:{order.id}:{creds[region]}"},
        {"idempotency_key": lambda order_id, api_token, **_: f"pay:{order_id}"},  # cannot be read: documented
        {"exclusive_key": "invoice:{order_id}", "ordering_key": "acct:{order_id}"},
        {"concurrency_key": "tenant:{tenant}", "concurrency_limit": 2},
        {"idempotency_key": "static-key"},
    ):
        validate_task(keyed_task(app, **attributes))
    # a key given per call is a value, not a template: it is not read for field names
    assert validate({"idempotency_key": "pay:{api_token}"}, scope="call") == {"idempotency_key": "pay:{api_token}"}


def test_redact_keys_of_the_task_decide_what_its_templates_may_name() -> None:
    from celery_guardrails.options import validate_task

    app = Celery("templates-task-keys", set_as_current=False)
    # a task that redacts "account" may not key by it; one that does not may
    with pytest.raises(ConfigurationError, match="redact_keys entry 'account'"):
        validate_task(keyed_task(app, idempotency_key="{order.account}", redact_keys=["account"]))
    validate_task(keyed_task(app, idempotency_key="{order.account}"))


def test_a_worker_does_not_start_with_a_key_template_naming_a_secret(celery_app: Any) -> None:
    # Given a guarded task of the worker's app keyed by its API token
    keyed_task(celery_app, idempotency_key="pay:{api_token}")
    # When a worker is made for the app, Then its start-up step refuses it, naming task, option and field
    with pytest.raises(ConfigurationError, match=r"'idempotency_key': on task 'shop\.pay\d+': field \{api_token\}"):
        celery_app.WorkController(pool_cls="solo", concurrency=1, without_heartbeat=True, without_mingle=True)


def test_a_worker_refusing_seal_keys_given_as_a_dict_logs_no_piece_of_a_key(tmp_path: Path, queue_name: str) -> None:
    from cryptography.fernet import Fernet

    # Given a worker whose seal_keys came as a dict of named keys (a common slip: {"primary": key})
    require("redis")
    key = Fernet.generate_key().decode()
    env = proj_env(queue=queue_name, GUARDRAILS_TEST_GUARDRAILS=json.dumps({"seal_keys": {"primary": key}}))
    worker = WorkerProcess(app=PROJ_APP, queue=queue_name, log_path=tmp_path / "worker.log", env=env)
    # When it starts, Then it exits naming the setting, and its log holds no piece of the key
    with pytest.raises(RuntimeError, match="exited with 1"):
        worker.start()
    assert (
        "setting 'seal_keys': must be a list of Fernet keys (the first seals, every one opens), got a dict"
        in worker.log
    )
    assert not any(key[i : i + 6] in worker.log for i in range(len(key) - 5))


def test_a_store_that_cannot_be_reached_is_named_without_its_password() -> None:
    from celery_guardrails.exceptions import StoreUnavailableError
    from celery_guardrails.stores.redis import RedisStore

    # Given a Redis store whose URL holds a password, and nothing listening where it points
    store = RedisStore(f"redis://app:{SECRET}@127.0.0.1:1/0", timeout=1.0)
    # When an operation fails, Then its error (logged by every caller) names the store with its password masked
    with pytest.raises(StoreUnavailableError) as caught:
        store.inspect("some-key")
    assert str(caught.value).startswith("Redis store at redis://***@127.0.0.1:1/0 unavailable: ")
    assert SECRET[:6] not in str(caught.value)
