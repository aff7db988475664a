"""``manage.py guardrails_audit`` and the audit's system checks, on the example project and on a bad config.

Each runs as an operator runs it, in a subprocess: the audit grades every task registered in the process, and
this test process holds the whole suite's tasks as well as the project's. The example project's source is read
under its BASE_DIR (example_project/), and, since that folder holds no test of its own, its tests under the
repository (its tests/example_project/ uses the test kit for every shop task).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.audit_apps import AXES
from tests.support.waiting import BOUND
from tests.support.workers import ROOT

SHOP = "example_project.shop.tasks"

#: What the example project is audited to, and why: three tasks the gate never retries (they mark no effect:
#: information), Celery's prefetch of 4 and metrics off (the demo names how to turn them on). (The demo's waits on
#: results go through one helper with a deadline, on a parameter the audit does not trace to a publish: not listed.)
EXAMPLE_FINDINGS = [
    ("GA309", f"{SHOP}.build_report"),
    ("GA309", f"{SHOP}.send_receipt"),
    ("GA309", f"{SHOP}.settle_payments"),
    ("GA502", "worker_prefetch_multiplier"),
    ("GA701", "metrics"),
]

#: The tasks of issue #27 on the example project's app (PLAIN, UNSAFE: with the plain task, the retry_unsafe one).
ISSUE27_MODULE = """
from example_project.celery_app import app
from tests.support.issue27 import add_issue27_tasks

add_issue27_tasks(app, plain={plain}, unsafe={unsafe})
"""
ISSUE27_SETTINGS = """
from example_project.settings import *  # noqa: F403

CELERY_IMPORTS = ["issue27_tasks"]
"""

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


#: django-celery-beat rows beside the example project's settings entry: a plain Celery task of the project's
#: own for one of them, and one row opted out.
ROW_TASKS = """
from celery import shared_task


@shared_task
def plain_cleanup():
    return None
"""
ROWS_SETTINGS = """
from example_project.settings import *  # noqa: F403

CELERY_IMPORTS = ["row_tasks"]
CELERY_GUARDRAILS = {
    **CELERY_GUARDRAILS,  # noqa: F405
    "schedules": {**CELERY_GUARDRAILS["schedules"], "row-opted-out": None},  # noqa: F405
}
"""
MAKE_ROWS = """
from django_celery_beat.models import IntervalSchedule, PeriodicTask

hourly = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS)
for name, task in [
    ("row-default", "example_project.shop.tasks.send_receipt"),
    ("row-plain", "row_tasks.plain_cleanup"),
    ("row-opted-out", "example_project.shop.tasks.send_receipt"),
]:
    PeriodicTask.objects.create(name=name, task=task, interval=hourly)
"""


def run(
    tmp_path: Path,
    *arguments: str,
    bad: bool = False,
    issue27: tuple[bool, bool] | None = None,
    rows: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``manage.py <arguments>`` of the example project (its settings, the bad ones, or with the tasks of issue
    #27: ``issue27`` = (with the plain task, with the retry_unsafe one); ``rows``: with a plain task of its own
    and a django-celery-beat row opted out)."""
    env = {**os.environ, "EXAMPLE_VAR_DIR": str(tmp_path / "var"), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if bad:
        (tmp_path / "bad_settings.py").write_text(BAD_SETTINGS)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
        env["DJANGO_SETTINGS_MODULE"] = "bad_settings"
    if issue27 is not None:
        plain, unsafe = issue27
        (tmp_path / "issue27_tasks.py").write_text(ISSUE27_MODULE.format(plain=plain, unsafe=unsafe))
        (tmp_path / "issue27_settings.py").write_text(ISSUE27_SETTINGS)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
        env["DJANGO_SETTINGS_MODULE"] = "issue27_settings"
    if rows:
        (tmp_path / "row_tasks.py").write_text(ROW_TASKS)
        (tmp_path / "rows_settings.py").write_text(ROWS_SETTINGS)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
        env["DJANGO_SETTINGS_MODULE"] = "rows_settings"
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


def test_the_example_project_passes_the_rubric_s_threshold(tmp_path: Path) -> None:
    # When the example project is audited
    done = run(tmp_path, "guardrails_audit", "--json")
    # Then it passes the rubric's threshold (no axis below 3, an average of 4 or more) on nine axes
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["min_score"], report["min_average"], report["passed"]) == (3, 4.0, True)
    assert (report["lowest"], report["average"]) == (4, 4.78)
    # And the axes below 5 are ordering (Celery's prefetch of 4) and observability (metrics off)
    assert [(axis["name"], axis["score"]) for axis in report["axes"]] == [
        ("placement", 5),
        ("message_design", 5),
        ("idempotency", 5),
        ("retry_policy", 5),
        ("dead_letters", 5),
        ("ordering_concurrency", 4),
        ("scheduled_work", 5),
        ("observability", 4),
        ("tests", 5),
    ]
    # And what it finds is what it keeps on purpose (EXAMPLE_FINDINGS says why)
    assert [(f["code"], f["subject"]) for f in report["findings"]] == EXAMPLE_FINDINGS
    # And its source is its BASE_DIR, its tests the repository's (BASE_DIR holds none)
    assert (report["source"], report["tests_source"]) == (str(ROOT / "example_project"), str(ROOT))


def test_the_command_prints_text_and_exits_1_below_the_threshold(tmp_path: Path) -> None:
    # When the example project is audited as text
    done = run(tmp_path, "guardrails_audit")
    # Then every axis is printed with its score, then the average, the folders read and the verdict
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if not line.startswith(" ")] == [
        "placement: 5/5",
        "message design: 5/5",
        "idempotency enforced: 5/5",
        "retry policy with classification: 5/5",
        "dead-letter ownership: 5/5",
        "ordering and concurrency: 4/5",
        "scheduled work: 5/5",
        "observability: 4/5",
        "tests: 5/5",
        "average: 4.78/5 over 9 axes",
        f"source read under {ROOT / 'example_project'}; tests read under {ROOT}",
        "OK: every axis scores 3 or more (lowest 4), and the average 4.78 is 4.0 or more",
    ]
    at = next(n for n, line in enumerate(lines) if line.startswith("  GA701 "))
    assert lines[at : at + 2] == [
        "  GA701 warning metrics: metrics is off: no Prometheus metrics (durations, outcomes, queue wait, arrivals "
        "against throughput)",
        "        fix: set metrics=True (the prometheus extra) and scrape metrics_port or the Django view",
    ]
    # When a bad configuration is audited, with a threshold of 4
    bad = run(tmp_path, "guardrails_audit", "--min-score", "4", bad=True)
    # Then the axes below it and the average are named, and the command exits 1
    assert bad.returncode == 1, bad.stderr
    verdict = "below 4: ordering and concurrency 0, observability 3"
    assert bad.stdout.splitlines()[-1] == f"FAIL: {verdict}"
    assert bad.stderr.splitlines()[-1] == f"CommandError: {verdict}"  # after the system checks' information
    # And the example project misses an average of 4.8
    strict = run(tmp_path, "guardrails_audit", "--min-average", "4.8")
    assert (strict.returncode, strict.stderr) == (1, "CommandError: average 4.78 below 4.8\n")
    # And a threshold that is not a score, or a source that is not a folder, is refused
    wrong = run(tmp_path, "guardrails_audit", "--min-score", "six")
    assert (wrong.returncode, wrong.stderr) == (1, "CommandError: --min-score 'six': give a whole number from 0 to 5\n")
    wrong = run(tmp_path, "guardrails_audit", "--min-average", "4,5")
    assert (wrong.returncode, wrong.stderr) == (1, "CommandError: --min-average '4,5': give a number from 0 to 5\n")
    wrong = run(tmp_path, "guardrails_audit", "--source", str(tmp_path / "nowhere"))
    assert (wrong.returncode, wrong.stderr) == (1, f"CommandError: --source '{tmp_path / 'nowhere'}': not a folder\n")


def test_a_bad_config_reports_its_findings_as_json(tmp_path: Path) -> None:
    # When the bad configuration is audited as JSON
    done = run(tmp_path, "guardrails_audit", "--json", bad=True)
    # Then each finding names the setting, task or beat entry to change (every guarded task retries longer than
    # the 300 s visibility timeout with the default backoff_max of 600 s)
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert [(f["code"], f["subject"]) for f in report["findings"]] == sorted(
        [
            *EXAMPLE_FINDINGS,
            ("GA102", "max_payload_bytes"),
            ("GA402", "alert_channels"),
            ("GA501", f"{SHOP}.build_report"),
            ("GA501", f"{SHOP}.charge_order"),
            ("GA501", f"{SHOP}.send_receipt"),
            ("GA501", f"{SHOP}.settle_payments"),
            ("GA501", f"{SHOP}.ship_order"),
            ("GA501", f"{SHOP}.update_stock"),
            ("GA607", "nightly-cleanup"),  # no policy written: watched with the default one
            ("GA702", "activity"),
        ]
    )
    (first,) = [f for f in report["findings"] if f["code"] == "GA501" and f["subject"] == f"{SHOP}.build_report"]
    assert first == {
        "code": "GA501",
        "axis": "ordering_concurrency",
        "severity": "warning",
        "subject": f"{SHOP}.build_report",
        "message": "backoff_max 600 s: not shorter than the Redis visibility_timeout 300 s: the message is delivered "
        "twice",
        "fix": "lower them below broker_transport_options['visibility_timeout'] (or raise it; keep broker_lease on)",
    }
    assert (report["lowest"], report["passed"]) == (0, False)


def test_the_tasks_of_issue_27_score_the_retry_axis_0(tmp_path: Path) -> None:
    # Given the example project with the tasks of issue #27: a GuardedTask that POSTs then calls a refused service
    # (no key), one with autoretry_for=(Exception,), one using self.retry() with max_attempts=3, a keyed task that
    # never hands its key on, one that does, one raising ValueError, a retry_unsafe one, and a plain Celery task
    # with autoretry_for and 20 fixed retries
    # When `guardrails_audit --json` runs
    done = run(tmp_path, "guardrails_audit", "--json", issue27=(True, True))
    # Then it shows nine axes, and the retry axis scores 0 (the zero rule): the retry_unsafe task and the plain
    # task are errors, each with its fix
    report = json.loads(done.stdout)
    scores = {axis["name"]: axis["score"] for axis in report["axes"]}
    assert list(scores) == AXES
    assert scores["retry_policy"] == 0
    errors = [
        (f["code"], f["subject"])
        for f in report["findings"]
        if f["axis"] == "retry_policy" and f["severity"] == "error"
    ]
    assert errors == [("GA301", "issue27.unsafe"), ("GA305", "issue27.plain")]
    assert {(f["code"], f["subject"]) for f in report["findings"] if f["subject"].startswith("issue27.")} >= {
        ("GA306", "issue27.plain"),
        ("GA307", "issue27.autoretried"),
        ("GA308", "issue27.plain"),
        ("GA202", "issue27.keyed_not_handed"),
    }
    # And `guardrails_audit --min-score 3` exits non-zero
    strict = run(tmp_path, "guardrails_audit", "--min-score", "3", issue27=(True, True))
    assert strict.returncode == 1
    assert strict.stderr.startswith("CommandError: below 3: retry policy with classification 0")
    # When the plain task and the retry_unsafe one are taken out
    safer = json.loads(run(tmp_path, "guardrails_audit", "--json", issue27=(False, False)).stdout)
    # Then the retry axis scores 3 or more
    (retries,) = [axis for axis in safer["axes"] if axis["name"] == "retry_policy"]
    assert retries["score"] >= 3
    assert [(f["code"], f["subject"]) for f in retries["findings"] if f["severity"] != "info"] == [
        ("GA307", "issue27.autoretried")
    ]


def test_the_source_option_reads_another_folder(tmp_path: Path) -> None:
    # Given a source tree with a view that waits on a task's result, and a kit test for the shop's tasks
    source = tmp_path / "src"
    (source / "shop").mkdir(parents=True)
    (source / "shop" / "views.py").write_text(
        "from example_project.shop.tasks import send_receipt\n\n\n"
        "def receipt(request, order_id):\n    return send_receipt.delay(order_id).get(timeout=10)\n"
    )
    (source / "shop" / "tests.py").write_text(
        "from celery_guardrails.testing import deliver_twice\n"
        "from example_project.shop.tasks import build_report, charge_order, send_receipt, settle_payments\n"
        "from example_project.shop.tasks import ship_order, update_stock\n"
    )
    # When the example project is audited with --source at it
    report = json.loads(run(tmp_path, "guardrails_audit", "--json", "--source", str(source)).stdout)
    # Then the view's wait is the placement finding, and the tests are read there too
    assert [(f["code"], f["subject"]) for f in report["findings"] if f["axis"] in ("placement", "tests")] == [
        ("GA003", "shop/views.py")
    ]
    assert (report["source"], report["tests_source"]) == (str(source), str(source))


def test_the_system_checks_raise_the_findings_of_a_bad_config_and_none_of_them_for_the_example(
    tmp_path: Path,
) -> None:
    # When `manage.py check --deploy` runs on the bad configuration
    bad = run(tmp_path, "check", "--deploy", bad=True)
    # Then each finding is a guardrails.W1xx warning naming its subject, with the fix as the hint
    assert sorted(audit_warnings(bad.stderr + bad.stdout)) == sorted(
        [
            *EXAMPLE_CHECKS,
            ("activity", "guardrails.W172"),
            ("alert_channels", "guardrails.W142"),
            (f"{SHOP}.build_report", "guardrails.W151"),
            (f"{SHOP}.charge_order", "guardrails.W151"),
            (f"{SHOP}.send_receipt", "guardrails.W151"),
            (f"{SHOP}.settle_payments", "guardrails.W151"),
            (f"{SHOP}.ship_order", "guardrails.W151"),
            (f"{SHOP}.update_stock", "guardrails.W151"),
            ("max_payload_bytes", "guardrails.W112"),
        ]
    )
    # And its beat entry without a policy is named by the plain check (watched with the default policy), not here
    assert (
        "schedules: (guardrails.I001) 1 beat entry is watched with the default policy (missed when later than its "
        "grace, overlap skip, catch-up latest): beat entry 'nightly-cleanup' (grace 60 s)."
    ) in (bad.stderr + bad.stdout)
    # When it runs on the example project
    example = run(tmp_path, "check", "--deploy")
    # Then none of the bad config's warnings: only the findings the example keeps on purpose
    assert sorted(audit_warnings(example.stderr + example.stdout)) == sorted(EXAMPLE_CHECKS)
    # And a plain `manage.py check` (not --deploy) runs no audit
    plain = run(tmp_path, "check")
    assert (plain.returncode, audit_warnings(plain.stderr + plain.stdout)) == (0, [])


#: EXAMPLE_FINDINGS as system checks.
EXAMPLE_CHECKS = [
    (f"{SHOP}.build_report", "guardrails.W139"),
    (f"{SHOP}.send_receipt", "guardrails.W139"),
    (f"{SHOP}.settle_payments", "guardrails.W139"),
    ("worker_prefetch_multiplier", "guardrails.W152"),
    ("metrics", "guardrails.W171"),
]


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


def test_the_audit_names_django_celery_beat_rows_watched_by_default_unwatched_and_opted_out(tmp_path: Path) -> None:
    # Given the example project's database with three django-celery-beat rows and no policy written for two: a
    # guarded task's, a plain Celery task's, and one opted out with schedules["row-opted-out"] = None
    for arguments in (["migrate", "-v0"], ["shell", "-c", MAKE_ROWS]):
        done = run(tmp_path, *arguments, rows=True)
        assert done.returncode == 0, done.stdout + done.stderr
    # When `guardrails_audit --json` runs
    done = run(tmp_path, "guardrails_audit", "--json", rows=True)
    report = json.loads(done.stdout)
    # Then each row is named by its own name, as a periodic task, with what the audit makes of it: watched with
    # the default policy (GA607), not watched because its task is a plain one (GA601), opted out (GA608)
    named = {f["subject"]: f for f in report["findings"] if f["subject"].startswith("row-")}
    assert {name: (f["code"], f["severity"]) for name, f in named.items()} == {
        "row-default": ("GA607", "info"),
        "row-plain": ("GA601", "warning"),
        "row-opted-out": ("GA608", "info"),
    }
    assert all(f["message"].startswith("a periodic task ") for f in named.values()), named
    assert "row_tasks.plain_cleanup is a plain Celery task" in named["row-plain"]["message"]
    assert named["row-plain"]["fix"].endswith('schedules["row-plain"] = None')
