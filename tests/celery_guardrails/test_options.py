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
