"""``manage.py guardrails_audit`` and the audit's system checks, on the example project and on a bad config.

Each runs as an operator runs it, in a subprocess: the audit grades every task registered in the process, and
this test process holds the whole suite's tasks as well as the project's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.waiting import BOUND
from tests.support.workers import ROOT

SHOP = "example_project.shop.tasks"

#: A bad configuration: the example project's settings, overridden.
BAD_SETTINGS = """
from example_project.settings import *  # noqa: F403

CELERY_BROKER_URL = "redis://127.0.0.1:6379/14"
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 300}
CELERY_BEAT_SCHEDULE = {
    **CELERY_BEAT_SCHEDULE,
    "nightly-cleanup": {"task": "example_project.shop.tasks.send_receipt", "schedule": 86400.0},
}
CELERY_GUARDRAILS = {
    **CELERY_GUARDRAILS,
    "alert_channels": ["log"],
    "max_payload_bytes": 0,
    "activity": False,
}
"""


def run(tmp_path: Path, *arguments: str, bad: bool = False) -> subprocess.CompletedProcess[str]:
    """``manage.py <arguments>`` of the example project (its settings, or the bad ones)."""
    env = {**os.environ, "EXAMPLE_VAR_DIR": str(tmp_path / "var"), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if bad:
        (tmp_path / "bad_settings.py").write_text(BAD_SETTINGS)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
        env["DJANGO_SETTINGS_MODULE"] = "bad_settings"
    return subprocess.run(
        [sys.executable, str(ROOT / "example_project" / "manage.py"), *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )


def audit_warnings(output: str) -> list[tuple[str, str]]:
    """(subject, id) of each guardrails.W1xx line ``manage.py check`` printed."""
    return re.findall(r"^(\S+): \((guardrails\.W1\d\d)\)", output, flags=re.MULTILINE)


def test_the_example_project_scores_no_axis_below_4(tmp_path: Path) -> None:
    # When the example project is audited
    done = run(tmp_path, "guardrails_audit", "--json")
    # Then it passes, and no axis scores below 4
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(axis["name"], axis["score"]) for axis in report["axes"]] == [
        ("message_design", 5),
        ("idempotency", 5),
        ("retry_policy", 5),
        ("dead_letters", 5),
        ("ordering_concurrency", 4),
        ("scheduled_work", 5),
        ("observability", 4),
    ]
    # And what it still finds is what the demo keeps on purpose: Celery's prefetch of 4, and metrics off (the demo
    # names how to turn them on)
    assert [(f["code"], f["subject"]) for f in report["findings"]] == [
        ("GA502", "worker_prefetch_multiplier"),
        ("GA701", "metrics"),
    ]
    assert (report["lowest"], report["min_score"], report["passed"]) == (4, 3, True)


def test_the_command_prints_text_and_exits_1_below_the_threshold(tmp_path: Path) -> None:
    # When the example project is audited as text
    done = run(tmp_path, "guardrails_audit")
    # Then every axis is printed with its score, then the verdict
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if not line.startswith(" ")] == [
        "message design: 5/5",
        "idempotency enforced: 5/5",
        "retry policy with classification: 5/5",
        "dead-letter ownership: 5/5",
        "ordering and concurrency: 4/5",
        "scheduled work: 5/5",
        "observability: 4/5",
        "OK: every axis scores 3 or more (lowest 4)",
    ]
    assert lines[-3:-1] == [
        "  GA701 warning metrics: metrics is off: no Prometheus metrics (durations, outcomes, queue wait, arrivals "
        "against throughput)",
        "        fix: set metrics=True (the prometheus extra) and scrape metrics_port or the Django view",
    ]
    # When a bad configuration is audited, with a threshold of 4
    bad = run(tmp_path, "guardrails_audit", "--min-score", "4", bad=True)
    # Then the axes below it are named, and the command exits 1
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.splitlines()[-1] == "FAIL: below 4: ordering and concurrency 0, observability 3"
    assert bad.stderr.splitlines() == ["CommandError: below 4: ordering and concurrency 0, observability 3"]
    # And a threshold that is not a score is refused
    wrong = run(tmp_path, "guardrails_audit", "--min-score", "six")
    assert (wrong.returncode, wrong.stderr) == (1, "CommandError: --min-score 'six': give a whole number from 0 to 5\n")


def test_a_bad_config_reports_its_findings_as_json(tmp_path: Path) -> None:
    # When the bad configuration is audited as JSON
    done = run(tmp_path, "guardrails_audit", "--json", bad=True)
    # Then each finding names the setting, task or beat entry to change (every guarded task retries longer than
    # the 300 s visibility timeout with the default backoff_max of 600 s)
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert [(f["code"], f["subject"]) for f in report["findings"]] == [
        ("GA102", "max_payload_bytes"),
        ("GA402", "alert_channels"),
        ("GA501", f"{SHOP}.build_report"),
        ("GA501", f"{SHOP}.charge_order"),
        ("GA501", f"{SHOP}.send_receipt"),
        ("GA501", f"{SHOP}.settle_payments"),
        ("GA502", "worker_prefetch_multiplier"),
        ("GA601", "nightly-cleanup"),
        ("GA701", "metrics"),
        ("GA702", "activity"),
    ]
    assert report["findings"][2] == {
        "code": "GA501",
        "axis": "ordering_concurrency",
        "severity": "warning",
        "subject": f"{SHOP}.build_report",
        "message": "backoff_max 600 s: not shorter than the Redis visibility_timeout 300 s: the message is delivered "
        "twice",
        "fix": "lower them below broker_transport_options['visibility_timeout'] (or raise it; keep broker_lease on)",
    }
    assert (report["lowest"], report["passed"]) == (0, False)


def test_the_system_checks_raise_the_findings_of_a_bad_config_and_none_of_them_for_the_example(
    tmp_path: Path,
) -> None:
    # When `manage.py check --deploy` runs on the bad configuration
    bad = run(tmp_path, "check", "--deploy", bad=True)
    # Then each finding is a guardrails.W1xx warning naming its subject, with the fix as the hint
    assert sorted(audit_warnings(bad.stderr + bad.stdout)) == [
        ("activity", "guardrails.W172"),
        ("alert_channels", "guardrails.W142"),
        (f"{SHOP}.build_report", "guardrails.W151"),
        (f"{SHOP}.charge_order", "guardrails.W151"),
        (f"{SHOP}.send_receipt", "guardrails.W151"),
        (f"{SHOP}.settle_payments", "guardrails.W151"),
        ("max_payload_bytes", "guardrails.W112"),
        ("metrics", "guardrails.W171"),
        ("nightly-cleanup", "guardrails.W161"),
        ("worker_prefetch_multiplier", "guardrails.W152"),
    ]
    assert 'HINT: add schedules["nightly-cleanup"] = ' in bad.stderr + bad.stdout
    # When it runs on the example project
    example = run(tmp_path, "check", "--deploy")
    # Then none of the bad config's warnings: only the two findings the example keeps on purpose
    assert sorted(audit_warnings(example.stderr + example.stdout)) == [
        ("metrics", "guardrails.W171"),
        ("worker_prefetch_multiplier", "guardrails.W152"),
    ]
    # And a plain `manage.py check` (not --deploy) runs no audit
    plain = run(tmp_path, "check")
    assert (plain.returncode, audit_warnings(plain.stderr + plain.stdout)) == (0, [])


def test_the_audit_check_never_raises(tmp_path: Path) -> None:
    # Given a Celery app that cannot be audited (its guardrails settings are invalid)
    (tmp_path / "broken_settings.py").write_text(
        "from example_project.settings import *  # noqa: F403\nCELERY_GUARDRAILS = {'tenant_requried': True}\n"
    )
    env = {**os.environ, "EXAMPLE_VAR_DIR": str(tmp_path / "var"), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env["DJANGO_SETTINGS_MODULE"] = "broken_settings"
    done = subprocess.run(
        [sys.executable, str(ROOT / "example_project" / "manage.py"), "check", "--deploy"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    # Then the checks report the bad key (E001) and no audit warning, and do not crash
    output = done.stderr + done.stdout
    assert "(guardrails.E001)" in output and "Traceback" not in output
    assert audit_warnings(output) == []
