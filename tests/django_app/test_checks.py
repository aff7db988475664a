"""System checks name the bad key of CELERY_GUARDRAILS and the missing middleware."""

from __future__ import annotations

from django.core.checks import run_checks
from django.test import override_settings


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
