"""System checks name the bad key of CELERY_GUARDRAILS and the missing middleware; every audit finding code has
its check id."""

from __future__ import annotations

import re
from pathlib import Path

from django.core.checks import run_checks
from django.test import override_settings

from celery_guardrails import audit
from django_celery_guardrails import checks
from django_celery_guardrails.checks import AUDIT_IDS


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
    # GA405, which W002 says already
    expected = {code: None if code == "GA405" else f"guardrails.W1{code[2]}{code[4]}" for code in codes}
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
