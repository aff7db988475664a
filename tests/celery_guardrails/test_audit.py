"""The deployment audit (celery_guardrails.audit) and ``celery -A proj guardrails audit``, run as a real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery

from celery_guardrails import GuardedTask
from celery_guardrails.audit import audit, render
from tests.support.audit_apps import BROKER, PLANTED, bad_app, good_app, own_tasks
from tests.support.waiting import BOUND
from tests.support.workers import ROOT

AXES = [
    "message_design",
    "idempotency",
    "retry_policy",
    "dead_letters",
    "ordering_concurrency",
    "scheduled_work",
    "observability",
]


def audit_command(app: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", f"tests.support.audit_apps:{app}", "guardrails", "audit", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=BOUND,
    )


def test_a_bad_app_reports_every_planted_finding_and_scores_its_axes() -> None:
    # Given an app with a plain task, retry_unsafe, a keyless idempotent task, a short visibility_timeout, prefetch 4,
    # no owners and only log alerts, schedules without policy, timezone or owner, metrics and activity off, ...
    app = bad_app()
    # When it is audited
    report = audit(app)
    # Then every planted finding is reported, and nothing else
    assert {(finding.code, finding.subject) for finding in report.findings} == PLANTED
    # And each axis lost a point per warning, two per error, none per info
    assert [(axis.name, axis.score) for axis in report.axes] == [
        ("message_design", 0),
        ("idempotency", 3),
        ("retry_policy", 1),
        ("dead_letters", 2),
        ("ordering_concurrency", 2),
        ("scheduled_work", 0),
        ("observability", 3),
    ]
    assert report.lowest == 0
    # And every finding sits on the axis its code names, once
    assert sorted((f.axis, f.code, f.subject) for a in report.axes for f in a.findings) == sorted(
        (f.axis, f.code, f.subject) for f in report.findings
    )


def test_findings_name_what_to_change_and_list_the_opt_outs_with_their_reason() -> None:
    # Given the bad app
    report = audit(bad_app())
    found = {(f.code, f.subject): f for f in report.findings}
    # Then the sensitive-payload opt-out is listed with its reason, as information
    secret = found[("GA103", "bad.secret")]
    assert (secret.axis, secret.severity) == ("message_design", "info")
    assert (
        secret.message
        == "carries sensitive values (allow_sensitive_payload): the legacy directory takes the raw password"
    )
    # And the visibility finding names each limit that is too long against the 300 s timeout
    slow = found[("GA501", "bad.slow")]
    assert slow.message.startswith(
        "backoff_max 900 s, retry_later_delay * retry_later_max 600 s, time_limit 600 s: not shorter than the Redis "
        "visibility_timeout 300 s"
    )
    # And the prefetch finding names the tasks without a short time_limit
    prefetch = found[("GA502", "worker_prefetch_multiplier")]
    assert "(bad.early, bad.keyless, bad.ordered, bad.plain, bad.plain_late, bad.report, bad.secret, bad.slow, " in (
        prefetch.message
    )
    # And the errors are the ones that refuse messages or a start-up
    assert sorted((f.code, f.subject) for f in report.findings if f.severity == "error") == [
        ("GA105", "bad.versions"),
        ("GA605", "plain-sync"),
    ]


def test_a_good_app_scores_5_on_every_axis() -> None:
    # Given an app with keyed, owned, guarded tasks, webhook alerts, seal keys, metrics, prefetch 1 and a
    # schedule with a stated zone and owner
    report = audit(good_app())
    # Then nothing is found
    assert report.findings == ()
    assert [(axis.name, axis.score) for axis in report.axes] == [(name, 5) for name in AXES]
    assert render(report, min_score=3).splitlines()[-1] == "OK: every axis scores 3 or more (lowest 5)"


def test_safe_defaults_are_not_findings() -> None:
    # Given an app with one keyed, owned guarded task and nothing else set but what has no safe default
    app = Celery("defaults", set_as_current=False)
    app.conf.update(
        broker_url=BROKER,
        worker_prefetch_multiplier=1,
        guardrails={
            "seal_keys": [good_app().conf.guardrails["seal_keys"][0]],
            "metrics": True,
            "alert_channels": ["log", "webhook"],
            "alert_webhooks": ["http://127.0.0.1:9/"],
        },
    )

    @app.task(shared=False, name="defaults.charge", base=GuardedTask, bind=True, owner="shop", idempotency_key="c:{n}")
    def charge(self: Any, n: int) -> None: ...

    own_tasks(app, "defaults.")
    # Then the defaults (payload limit 64 KiB, sensitive keys, backoff_max 600 s under the 3600 s visibility
    # timeout, acks_late and reject_on_worker_lost, activity on) cost nothing
    assert audit(app).findings == ()


def test_alerts_that_reach_nobody(settings: Any) -> None:
    # Given webhook and mail alerts with no webhook URL, no owner_emails and no ADMINS
    settings.ADMINS = []
    app = good_app()
    app.conf.guardrails = {**app.conf.guardrails, "alert_channels": ["webhook", "mail"], "alert_webhooks": []}
    # When it is audited
    report = audit(app)
    # Then both channels are named
    assert [(f.code, f.subject, f.message) for f in report.findings] == [
        ("GA403", "alert_webhooks", '"webhook" is an alert channel but alert_webhooks is empty: no alert is posted'),
        (
            "GA404",
            "owner_emails",
            '"mail" is an alert channel but no ADMINS, and no owner_emails for shop: no alert is mailed',
        ),
    ]
    # And with an address for the owner, mail reaches someone
    app.conf.guardrails = {**app.conf.guardrails, "owner_emails": {"shop": ["shop@example.com"]}}
    assert [f.code for f in audit(app).findings] == ["GA403"]


def test_a_policy_for_an_entry_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a policy naming no beat entry, without django-celery-beat (whose rows could hold it)
    monkeypatch.setattr("celery_guardrails.stores.django_apps_installed", lambda *names: False)
    app = good_app()
    app.conf.guardrails = {**app.conf.guardrails, "schedules": {**app.conf.guardrails["schedules"], "ghost": {}}}
    # Then it is an error: the worker and beat would refuse to start
    assert [(f.code, f.subject, f.severity) for f in audit(app).findings] == [("GA604", "ghost", "error")]


def test_the_command_prints_json_and_exits_1_below_the_threshold() -> None:
    # When `celery -A tests.support.audit_apps:bad guardrails audit --json` runs
    done = audit_command("bad", "--json")
    # Then it prints the report as JSON and exits 1 (axes below the default 3)
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert {(f["code"], f["subject"]) for f in printed["findings"]} == PLANTED
    assert [(axis["name"], axis["score"]) for axis in printed["axes"]] == [
        (axis.name, axis.score) for axis in audit(bad_app()).axes
    ]
    assert (printed["min_score"], printed["passed"], printed["lowest"]) == (3, False, 0)
    # And with the threshold at 0 the same report passes: exit 0
    lenient = audit_command("bad", "--json", "--min-score", "0")
    assert lenient.returncode == 0, lenient.stderr
    assert (json.loads(lenient.stdout)["passed"], json.loads(lenient.stdout)["findings"]) == (True, printed["findings"])


def test_the_command_prints_text_and_exits_0_above_the_threshold() -> None:
    # When the good app is audited with the highest threshold
    done = audit_command("good", "--min-score", "5")
    # Then each axis prints its score, and the command exits 0
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "message design: 5/5",
        "idempotency enforced: 5/5",
        "retry policy with classification: 5/5",
        "dead-letter ownership: 5/5",
        "ordering and concurrency: 5/5",
        "scheduled work: 5/5",
        "observability: 5/5",
        "OK: every axis scores 5 or more (lowest 5)",
    ]
    # And the bad app's text names each finding with its fix, and the axes below the threshold
    lines = audit_command("bad").stdout.splitlines()
    assert lines[:3] == [
        "message design: 0/5",
        "  GA101 warning bad.plain: a plain Celery task: no tenant or correlation context, no retry gate, no dead "
        "letter, no payload contract",
        "        fix: make it a GuardedTask: @shared_task(base=GuardedTask, bind=True, ...)",
    ]
    assert lines[-1] == (
        "FAIL: below 3: message design 0, retry policy with classification 1, dead-letter ownership 2, ordering and "
        "concurrency 2, scheduled work 0"
    )


def test_an_invalid_config_is_named_and_exits_2() -> None:
    # Given an app whose guardrails settings have a typo (the module's bad app, changed in a subprocess)
    code = (
        "import sys\n"
        "from celery.bin.celery import celery\n"
        "from tests.support import audit_apps\n"
        "audit_apps.bad.conf.guardrails = {'tenant_requried': True}\n"
        "sys.exit(celery.main(['-A', 'tests.support.audit_apps:bad', 'guardrails', 'audit'], standalone_mode=True))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    # Then the command names the key and exits 2, grading nothing
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert "'tenant_requried': unknown key; did you mean 'tenant_required'?" in done.stderr
