"""The deployment audit (celery_guardrails.operations.audit) and ``celery -A proj guardrails audit``, run as a real
command.

Every audit here is given its source (``source=`` / ``--source``): a folder the test writes, so that what the
placement and tests axes read is the test's, not this repository's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_guardrails.testing
import celery_guardrails.testing.plugin
from celery_guardrails import GuardedTask
from celery_guardrails.operations import audit_source
from celery_guardrails.operations.audit import audit, graded_tasks, render, report_of, retry_rules
from celery_guardrails.runtime.install import warn_about
from celery_guardrails.testing import entry
from tests.support import zygote
from tests.support.audit_apps import (
    AXES,
    BROKER,
    ISSUE27_RETRIES,
    PLANTED,
    bad_app,
    good_app,
    good_tree,
    issue27_app,
    kit_test,
    own_tasks,
    write_tree,
)
from tests.support.logs import Caught
from tests.support.waiting import BOUND
from tests.support.workers import ROOT


def audit_command(app: str, *args: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, "-m", "celery", "-A", f"tests.support.audit_apps:{app}", "guardrails", "audit", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=BOUND,
    )


def test_a_bad_app_reports_every_planted_finding_and_scores_its_axes(tmp_path: Path) -> None:
    # Given an app with a plain task, retry_unsafe, a keyless idempotent task, a short visibility_timeout, prefetch 4,
    # no owners and only log alerts, schedules without policy, timezone or owner, metrics and activity off, ...
    # and a source with no test at all
    app = bad_app()
    # When it is audited
    report = audit(app, source=tmp_path)
    # Then every planted finding is reported, and nothing else
    assert {(finding.code, finding.subject) for finding in report.findings} == PLANTED
    # And each axis lost a point per warning, two per error, none per info; retry_unsafe scores its axis 0
    assert [(axis.name, axis.score) for axis in report.axes] == [
        ("placement", 5),
        ("message_design", 0),
        ("idempotency", 1),
        ("retry_policy", 0),
        ("dead_letters", 2),
        ("ordering_concurrency", 2),
        ("scheduled_work", 0),
        ("observability", 3),
        ("tests", 0),
    ]
    assert (report.lowest, round(report.average, 2), report.passed()) == (0, 1.44, False)
    # And every finding sits on the axis its code names, once
    assert sorted((f.axis, f.code, f.subject) for a in report.axes for f in a.findings) == sorted(
        (f.axis, f.code, f.subject) for f in report.findings
    )


def test_findings_name_what_to_change_and_list_the_opt_outs_with_their_reason(tmp_path: Path) -> None:
    # Given the bad app
    report = audit(bad_app(), source=tmp_path)
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
    # And the errors are the ones that refuse messages or a start-up, act twice, or leave the tasks untested
    assert sorted((f.code, f.subject) for f in report.findings if f.severity == "error") == [
        ("GA105", "bad.versions"),
        ("GA301", "bad.unsafe"),
        ("GA605", "plain-sync"),
        ("GA801", "tests"),
    ]
    # And the untested tasks are told where to start: an ordered task with out_of_order, a versioned one with
    # deploy_during_processing, the others with deliver_twice
    fixes = {f.subject: f.fix for f in report.findings if f.code == "GA802"}
    assert fixes["bad.ordered"].startswith("start with out_of_order(ordered, [...])")
    assert fixes["bad.versions"].startswith("start with deploy_during_processing(versions, old=Release(...)")
    assert fixes["bad.slow"].startswith("start with deliver_twice(slow, ...) with assert_single_effect")
    assert found[("GA801", "tests")].message == (
        f"no test file under {tmp_path.resolve()} uses the test kit (celery_guardrails.testing): no test delivers a "
        "guarded task twice, kills it mid-task or poisons it"
    )


def test_a_good_app_scores_5_on_every_axis(tmp_path: Path) -> None:
    # Given an app with keyed, owned, guarded tasks that hand their key on or mark their effect, webhook alerts,
    # seal keys, metrics, prefetch 1, a schedule with a stated zone and owner, and a test that uses the kit for both
    report = audit(good_app(), source=good_tree(tmp_path))
    # Then nothing is found
    assert report.findings == ()
    assert [(axis.name, axis.score) for axis in report.axes] == [(name, 5) for name in AXES]
    assert render(report).splitlines()[-3:] == [
        "average: 5.00/5 over 9 axes",
        f"source read under {tmp_path.resolve()}",
        "OK: every axis scores 3 or more (lowest 5), and the average 5.00 is 4.0 or more",
    ]


def test_safe_defaults_are_not_findings(tmp_path: Path) -> None:
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
    def charge(self: Any, n: int) -> str | None:
        return self.request.idempotency_key  # handed on (to whatever acts)

    own_tasks(app, "defaults.")
    # And a test that uses the kit for it
    write_tree(tmp_path, {"test_charge.py": kit_test("charge")})
    # Then the defaults (payload limit 64 KiB, sensitive keys, backoff_max 600 s under the 3600 s visibility
    # timeout, acks_late and reject_on_worker_lost, activity on, eager off) cost nothing
    assert audit(app, source=tmp_path).findings == ()


def test_alerts_that_reach_nobody(settings: Any, tmp_path: Path) -> None:
    # Given webhook and mail alerts with no webhook URL, no owner_emails and no ADMINS
    settings.ADMINS = []
    app = good_app()
    app.conf.guardrails = {**app.conf.guardrails, "alert_channels": ["webhook", "mail"], "alert_webhooks": []}
    good_tree(tmp_path)
    # When it is audited
    report = audit(app, source=tmp_path)
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
    assert [f.code for f in audit(app, source=tmp_path).findings] == ["GA403"]


def test_a_policy_for_an_entry_that_does_not_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Given a policy naming no beat entry, without django-celery-beat (whose rows could hold it)
    monkeypatch.setattr("celery_guardrails.stores.django_apps_installed", lambda *names: False)
    app = good_app()
    app.conf.guardrails = {**app.conf.guardrails, "schedules": {**app.conf.guardrails["schedules"], "ghost": {}}}
    # Then it is an error: the worker and beat would refuse to start
    found = audit(app, source=good_tree(tmp_path)).findings
    assert [(f.code, f.subject, f.severity) for f in found] == [("GA604", "ghost", "error")]


def test_the_command_prints_json_and_exits_1_below_the_threshold(tmp_path: Path) -> None:
    # When `celery -A tests.support.audit_apps:bad guardrails audit --json` runs, on a source with no tests
    done = audit_command("bad", "--json", "--source", str(tmp_path))
    # Then it prints the report as JSON and exits 1 (axes below the default 3)
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert {(f["code"], f["subject"]) for f in printed["findings"]} == PLANTED
    assert [(axis["name"], axis["score"]) for axis in printed["axes"]] == [
        (axis.name, axis.score) for axis in audit(bad_app(), source=tmp_path).axes
    ]
    assert (printed["min_score"], printed["min_average"], printed["passed"], printed["lowest"]) == (3, 4.0, False, 0)
    assert (printed["average"], printed["source"], printed["tests_source"]) == (1.44, str(tmp_path), str(tmp_path))
    # And with the threshold at 0 the same report passes: exit 0
    lenient = audit_command("bad", "--json", "--min-score", "0", "--min-average", "0", "--source", str(tmp_path))
    assert lenient.returncode == 0, lenient.stderr
    assert (json.loads(lenient.stdout)["passed"], json.loads(lenient.stdout)["findings"]) == (True, printed["findings"])
    # And no axis below 0 is not enough when the average is below its threshold
    average = audit_command("bad", "--json", "--min-score", "0", "--source", str(tmp_path))
    assert (average.returncode, json.loads(average.stdout)["passed"]) == (1, False)


def test_the_command_prints_text_and_exits_0_above_the_threshold(tmp_path: Path) -> None:
    # When the good app is audited with the highest thresholds
    source = good_tree(tmp_path / "good")
    done = audit_command("good", "--min-score", "5", "--min-average", "5", "--source", str(source))
    # Then each axis prints its score, then the average, and the command exits 0
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "placement: 5/5",
        "message design: 5/5",
        "idempotency enforced: 5/5",
        "retry policy with classification: 5/5",
        "dead-letter ownership: 5/5",
        "ordering and concurrency: 5/5",
        "scheduled work: 5/5",
        "observability: 5/5",
        "tests: 5/5",
        "average: 5.00/5 over 9 axes",
        f"source read under {source}",
        "OK: every axis scores 5 or more (lowest 5), and the average 5.00 is 5.0 or more",
    ]
    # And the bad app's text names each finding with its fix, the axes below the threshold and the average
    (tmp_path / "bad").mkdir()
    lines = audit_command("bad", "--source", str(tmp_path / "bad")).stdout.splitlines()
    assert lines[:4] == [
        "placement: 5/5",
        "message design: 0/5",
        "  GA101 warning bad.plain: a plain Celery task: no tenant or correlation context, no retry gate, no dead "
        "letter, no payload contract",
        "        fix: make it a GuardedTask: @shared_task(base=GuardedTask, bind=True, ...)",
    ]
    assert lines[-1] == (
        "FAIL: below 3: message design 0, idempotency enforced 1, retry policy with classification 0, dead-letter "
        "ownership 2, ordering and concurrency 2, scheduled work 0, tests 0; average 1.44 below 4.0"
    )
    # And a source that is not a folder is refused before anything is graded
    missing = audit_command("good", "--source", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_the_tasks_of_issue_27_score_the_retry_axis_0_and_without_the_unsafe_ones_at_least_3(tmp_path: Path) -> None:
    # Given the tasks of issue #27: a GuardedTask that POSTs then calls a refused service (no key), one with
    # autoretry_for=(Exception,), one using self.retry() with max_attempts=3, a keyed task that never hands its
    # key on, one that does, one raising ValueError, a retry_unsafe one, and a plain task retried 20 times at a
    # fixed interval
    good_tree(tmp_path)  # (a kit test naming none of them)
    report = audit(issue27_app(), source=tmp_path)
    # Then the retry rules find each, and nothing for the task that hands its key on nor for the ValueError
    # (deterministic: permanent, never retried)
    retries = {(f.code, f.subject) for f in report.findings if f.code[2] in "23"}
    assert retries == ISSUE27_RETRIES
    # And the retry axis scores 0 (the zero rule), the two handlers retried while not idempotent are errors
    (axis,) = [axis for axis in report.axes if axis.name == "retry_policy"]
    assert axis.score == 0
    assert sorted((f.code, f.subject) for f in axis.findings if f.severity == "error") == [
        ("GA301", "issue27.unsafe"),
        ("GA305", "issue27.plain"),
    ]
    # And each error says how to make the re-run safe
    assert all("with self.effect():" in f.fix for f in axis.findings if f.severity == "error")
    assert not report.passed()
    # When the plain task and the retry_unsafe one are taken out
    safer = audit(issue27_app(plain=False, unsafe=False), source=tmp_path)
    # Then the retry axis scores at least 3: only the GuardedTask retried on any error costs it a point (the gate
    # keeps its re-runs safe); the keyed task that never hands its key on costs idempotency a point
    (axis,) = [axis for axis in safer.axes if axis.name == "retry_policy"]
    assert axis.score == 4
    assert [(f.code, f.subject, f.severity) for f in axis.findings if f.severity != "info"] == [
        ("GA307", "issue27.autoretried", "warning")
    ]
    # And the tasks the gate never retries are listed, each saying how to get retries
    infos = {f.subject: f for f in axis.findings if f.severity == "info"}
    assert sorted(infos) == [
        "issue27.asks_again",
        "issue27.autoretried",
        "issue27.charge_then_notify",
        "issue27.invalid",
    ]
    assert infos["issue27.asks_again"].message.endswith(
        "; its self.retry() cannot run it again (a final failure, not_idempotent)"
    )
    assert infos["issue27.charge_then_notify"].fix.startswith("for retries, mark the call that acts with")


def test_the_command_on_the_tasks_of_issue_27_exits_1(tmp_path: Path) -> None:
    # When `celery -A tests.support.audit_apps:issue27 guardrails audit --json --min-score 3` runs
    done = audit_command("issue27", "--json", "--min-score", "3", "--source", str(good_tree(tmp_path)))
    # Then it shows nine axes, the retry axis at 0, and exits 1
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert [axis["name"] for axis in printed["axes"]] == AXES
    assert [axis["score"] for axis in printed["axes"] if axis["name"] == "retry_policy"] == [0]
    assert printed["passed"] is False


def test_plain_tasks_retry_policies(tmp_path: Path) -> None:
    # Given plain Celery tasks: one with exponential backoff, one retrying itself at a fixed countdown under
    # `except Exception`, one retrying for ever with a computed countdown, one that never retries
    app = Celery("plain", set_as_current=False)
    app.conf.update(broker_url=BROKER)

    @app.task(shared=False, name="plain.backoff", autoretry_for=(ConnectionError,), retry_backoff=True)
    def backoff() -> None: ...

    @app.task(shared=False, name="plain.manual", bind=True)
    def manual(self: Any) -> None:
        try:
            backoff()
        except Exception as exc:
            raise self.retry(exc=exc, countdown=5) from exc

    @app.task(shared=False, name="plain.forever", bind=True, max_retries=None)
    def forever(self: Any) -> None:
        raise self.retry(countdown=2**self.request.retries)

    @app.task(shared=False, name="plain.quiet")
    def quiet() -> None: ...

    own_tasks(app, "plain.")
    # When its retry rules are read
    found = {(f.code, f.subject): f for f in retry_rules(app, graded_tasks(app))}
    # Then every retried plain task breaks the zero rule, and each bad policy is named
    assert sorted(found) == [
        ("GA305", "plain.backoff"),
        ("GA305", "plain.forever"),
        ("GA305", "plain.manual"),
        ("GA306", "plain.manual"),
        ("GA307", "plain.manual"),
        ("GA308", "plain.forever"),
    ]
    assert found[("GA305", "plain.manual")].message.startswith(
        "a plain Celery task retried automatically (.retry( in its code): Celery runs it again whatever it did"
    )
    assert re.search(r"\(self\.retry\(\) on line \d+ waits 5 s\)", found[("GA306", "plain.manual")].message)
    assert found[("GA307", "plain.manual")].message.startswith("retried on any error (self.retry() under a broad")
    assert found[("GA308", "plain.forever")].message.startswith("max_retries=None (for ever)")


def test_guarded_tasks_that_are_safe_to_retry_are_not_findings() -> None:
    # Given guarded tasks made safe to run again by construction: keyed and atomic, keyed and handing the key
    # on, marking their effects, idempotent with a key; and one allowed 20 attempts
    app = Celery("safe", set_as_current=False)
    app.conf.update(broker_url=BROKER)

    @app.task(shared=False, name="safe.atomic", base=GuardedTask, bind=True, idempotency_key="a:{n}", atomic=True)
    def atomic(self: Any, n: int) -> None: ...

    @app.task(shared=False, name="safe.handed", base=GuardedTask, bind=True, idempotency_key="h:{n}")
    def handed(self: Any, n: int) -> str | None:
        return self.request.idempotency_key

    @app.task(shared=False, name="safe.marked", base=GuardedTask, bind=True)
    def marked(self: Any) -> None:
        with self.effect():
            pass

    @app.task(shared=False, name="safe.idempotent", base=GuardedTask, bind=True, idempotent=True, idempotency_key="i")
    def idempotent(self: Any) -> None: ...

    @app.task(
        shared=False,
        name="safe.stubborn",
        base=GuardedTask,
        bind=True,
        idempotent=True,
        idempotency_key="s",
        max_attempts=20,
    )
    def stubborn(self: Any) -> None: ...

    own_tasks(app, "safe.")
    # Then only the 20 attempts are found
    findings = retry_rules(app, graded_tasks(app))
    assert [(f.code, f.subject, f.message) for f in findings] == [
        ("GA308", "safe.stubborn", "max_attempts=20: up to 20 runs of one message")
    ]


def test_the_zero_rule_scores_the_retry_axis_0_whatever_else_is_right(tmp_path: Path) -> None:
    # Given the good app with one retry_unsafe task more (keyed: nothing else is wrong with it)
    app = good_app()

    @app.task(shared=False, name="good.unsafe", base=GuardedTask, bind=True, retry_unsafe=True, idempotency_key="u:{n}")
    def unsafe(self: Any, n: int) -> None: ...

    write_tree(tmp_path, {"tests/test_good.py": kit_test("charge", "settle", "unsafe")})
    # When it is audited
    report = audit(app, source=tmp_path)
    # Then its one error scores the retry axis 0, not 3, and every other axis 5
    assert [(f.code, f.subject, f.severity) for f in report.findings] == [("GA301", "good.unsafe", "error")]
    assert [(axis.name, axis.score) for axis in report.axes] == [
        (name, 0 if name == "retry_policy" else 5) for name in AXES
    ]
    # And the same error on its own, on another axis' scoring, would cost 2 points: the zero rule is the retry axis'
    assert [axis.score for axis in report_of(report.findings).axes if axis.name == "retry_policy"] == [0]
    # And the average 4.44 passes, but the axis at 0 fails the threshold
    assert report.failures() == ["below 3: retry policy with classification 0"]


def test_the_worker_logs_the_audit_s_retry_rules_as_it_starts() -> None:
    # Given the tasks of issue #27
    app = issue27_app()
    guarded = [task for task in app.tasks.values() if isinstance(task, GuardedTask)]
    # When a worker's start-up warnings are logged (caught on the extension's logger itself: Celery's Django
    # fixup configures logging again as the app imports its modules, which takes pytest's handler off the root)
    caught = Caught()
    logger = logging.getLogger("celery_guardrails.runtime.install")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(caught)
    try:
        warn_about(app, guarded)
    finally:
        logger.removeHandler(caught)
        logger.setLevel(level)
    # Then each of the audit's retry findings is a line, at the level of its severity
    logged = [
        (record.levelname, record.getMessage())
        for record in caught.records
        if "celery-guardrails: GA" in record.getMessage()
    ]
    expected = [
        (
            {"error": "ERROR", "warning": "WARNING", "info": "INFO"}[f.severity],
            f"celery-guardrails: {f.code} {f.subject}: {f.message}; fix: {f.fix}",
        )
        for f in retry_rules(app, graded_tasks(app))
    ]
    assert logged == expected
    assert {(level, message.split(":")[1].strip()) for level, message in logged if level == "ERROR"} == {
        ("ERROR", "GA301 issue27.unsafe"),
        ("ERROR", "GA305 issue27.plain"),
    }


def startup_lines(app: Celery) -> list[str]:
    """What a worker logs about ``app`` as it starts: the bootstep's warnings, its read of the beat entries and
    its consumer's RabbitMQ check (caught on the extension's loggers, as in the test above)."""
    from celery_guardrails.broker.lease import check_consumer_timeout
    from celery_guardrails.scheduling.beat import configured_entries

    caught = Caught()
    names = ("runtime.install", "scheduling.beat", "scheduling.entries", "broker.lease")
    loggers = [logging.getLogger(f"celery_guardrails.{name}") for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(caught)
    try:
        warn_about(app, [task for task in app.tasks.values() if isinstance(task, GuardedTask)])
        configured_entries(app, every_row=False)
        check_consumer_timeout(app)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(caught)
            logger.setLevel(level)
    return [record.getMessage() for record in caught.records]


SENTINEL = "sentinel://127.0.0.1:26379"
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
#: Each rule a worker warns about at start-up and the audit grades: (code, the unsafe change to the good app, the
#: safe one, the finding's subject, the start-up line's words).
ONE_RULE = [
    ("GA401", {"guardrails": {"owners": {}}}, {}, "good.charge", "can dead-letter with no owner to alert"),
    ("GA501", {"broker_transport_options": {"visibility_timeout": 300}}, {}, "good.charge", "GA501 good.charge:"),
    (
        "GA501",
        {"broker_url": SENTINEL, "broker_transport_options": {"visibility_timeout": 300}},
        {"broker_url": SENTINEL, "broker_transport_options": {"visibility_timeout": 3000}},
        "good.charge",
        "GA501 good.charge:",
    ),
    ("GA106", {"guardrails": {"redact_keys": []}}, {}, "redact_keys", "GA106 redact_keys:"),
    ("GA602", {"guardrails": {"schedules": {"settle": {"owner": "shop"}}}}, {}, "settle", "'settle' is a crontab"),
    (
        "GA504",
        {"broker_url": RABBITMQ},
        {"broker_url": RABBITMQ, "task_time_limit": 60},
        "good.charge",
        "may run longer than RabbitMQ's consumer_timeout (1800s)",
    ),
]


@pytest.mark.parametrize(("code", "unsafe", "safe", "subject", "words"), ONE_RULE)
def test_the_start_up_warning_and_the_audit_finding_are_one_rule(
    tmp_path: Path, code: str, unsafe: dict[str, Any], safe: dict[str, Any], subject: str, words: str
) -> None:
    for change, fires in ((unsafe, True), (safe, False)):
        # Given the good app with one setting made unsafe, and the same setting safe
        app = good_app()
        for key, value in change.items():
            app.conf[key] = {**app.conf[key], **value} if key == "guardrails" else value
        # When a worker starts with it and it is audited
        logged = [line for line in startup_lines(app) if words in line and (code == "GA602" or subject in line)]
        found = [f for f in audit(app, source=good_tree(tmp_path)).findings if (f.code, f.subject) == (code, subject)]
        # Then both say it on the unsafe configuration, and neither on the safe one
        assert (bool(logged), bool(found)) == (fires, fires), (change, logged, found)


def test_placement_findings_from_a_source_tree(tmp_path: Path) -> None:
    # Given a project that runs its tasks eagerly, publishes inside transactions and waits on results in views
    write_tree(tmp_path, PLACEMENT_TREE)
    app = good_app()
    app.conf.task_always_eager = True
    good_tree(tmp_path)
    # When it is audited
    report = audit(app, source=tmp_path)
    # Then eager is an error, and each file with a publish in a transaction or a wait on a result is named,
    # with its lines and functions; the safe hand-overs, the tests, the task module, the migrations, the
    # virtualenv and a dict's get() are not
    found = {(f.code, f.subject): f for f in report.findings}
    assert sorted((code, subject, found[code, subject].severity) for code, subject in found) == [
        ("GA001", "task_always_eager", "error"),
        ("GA002", "shop/views.py", "warning"),
        ("GA003", "shop/views.py", "warning"),
        ("GA004", "scripts/report.py", "info"),
    ]
    assert found["GA002", "shop/views.py"].message.startswith(
        "publishes a task inside a database transaction, lines 10 (checkout), 23 (refund): the worker can run it"
    )
    assert found["GA003", "shop/views.py"].message.startswith(
        "waits on a task's result, lines 15 (checkout), 24 (refund), 28 (status), 35 (Orders.get): the caller"
    )
    assert found["GA004", "scripts/report.py"].message.startswith("waits on a task's result, line 5 (main), in a")
    assert "delay_on_commit" in found["GA002", "shop/views.py"].fix
    # And the placement axis scores 5 - 2 - 1 - 1
    assert [axis.score for axis in report.axes if axis.name == "placement"] == [1]


#: A project's source, for the placement axis: what is a finding and what is not (line numbers matter).
PLACEMENT_TREE = {
    "shop/views.py": """from django.db import transaction
from django.views import View
from celery.result import AsyncResult
from shop.tasks import charge


def checkout(request, order_id):
    with transaction.atomic():
        order_id = int(order_id)
        charge.delay(order_id)
        transaction.on_commit(lambda: charge.delay(order_id))
        charge.delay_on_commit(order_id)
        charge.apply_async((order_id,), outbox=True)
        charge.enqueue_in_transaction(order_id)
    return charge.delay(order_id).get(timeout=10)


@transaction.atomic
def refund(request, order_id):
    def later():
        return charge.delay(order_id)  # runs when called: not in the transaction

    result = charge.apply_async((order_id,))
    return result.wait(), later


def status(request, task_id):
    return AsyncResult(task_id).get()


class Orders(View):
    def get(self, request):
        cache = {"a": 1}
        result = charge.delay(1)
        return result.get(timeout=5)

    def post(self, request):
        result = charge.delay(1)
        result = cache_lookup()
        return cache_lookup().get("a"), result.get("a")


def cache_lookup():
    return {}
""",
    "shop/tasks.py": """from celery import shared_task


@shared_task
def charge(order_id):
    return order_id


@shared_task
def chained():
    return charge.delay(1).get(disable_sync_subtasks=False)
""",
    "scripts/report.py": """from shop.tasks import charge


def main():
    print(charge.delay(1).get(timeout=60))


if __name__ == "__main__":
    main()
""",
    "shop/tests.py": """from django.db import transaction
from shop.tasks import charge


def test_checkout():
    with transaction.atomic():
        assert charge.delay(1).get() == 1
""",
    "shop/migrations/0002_backfill.py": "from django.db import transaction\nwith transaction.atomic():\n    x.delay()",
    "node_modules/pkg/build.py": "x.delay().get()\n",
    ".venv/lib/site.py": "x.delay().get()\n",
    "env/pyvenv.cfg": "home = /usr/bin\n",
    "env/lib/thing.py": "x.delay().get()\n",
    "shop/broken.py": "def (:\n  x.delay().get()\n",
}


def test_the_tests_axis_without_the_kit_and_with_the_kit_for_one_task_only(tmp_path: Path) -> None:
    # Given a project with tests, none of which uses the kit
    app = good_app()
    write_tree(tmp_path, {"shop/tests/test_views.py": "def test_index(client):\n    charge.delay(1)\n"})
    # When it is audited
    report = audit(app, source=tmp_path)
    # Then having no kit at all is an error, and each guarded task is untested with the kit
    assert [(f.code, f.subject, f.severity) for f in report.findings] == [
        ("GA801", "tests", "error"),
        ("GA802", "good.charge", "warning"),
        ("GA802", "good.settle", "warning"),
    ]
    assert report.findings[0].message.startswith("none of the 1 test files under ")
    # When a test that uses the kit (through its fixture, in a conftest-enabled tree) names one task
    write_tree(
        tmp_path,
        {
            "shop/tests/conftest.py": 'pytest_plugins = ["celery_guardrails.testing"]\n',
            "shop/tests/test_charge.py": "def test_once(guardrails_kit):\n    guardrails_kit.deliver_twice(charge)\n",
        },
    )
    report = audit(app, source=tmp_path)
    # Then only the other is found, with the helper to start with
    assert [(f.code, f.subject, f.fix) for f in report.findings] == [
        (
            "GA802",
            "good.settle",
            "start with deliver_twice(settle, ...) with assert_single_effect (a duplicate delivery), then "
            "crash_mid_task and poison, in a test marked @pytest.mark.guardrails",
        )
    ]
    assert [axis.score for axis in report.axes if axis.name == "tests"] == [4]


def test_a_task_is_named_by_what_a_kit_test_imports_or_uses_not_by_a_name_it_assigns(tmp_path: Path) -> None:
    # Given a decorated task called report and a class-based task (its body is a run method)
    app = Celery("names", set_as_current=False)
    app.conf.update(broker_url=BROKER, guardrails={"owners": {"names.*": "shop"}})

    @app.task(shared=False, name="names.report", base=GuardedTask, bind=True, idempotent=True, idempotency_key="r")
    def report(self: Any) -> None: ...

    class Refund(GuardedTask):
        name = "names.refund"
        idempotent = True
        idempotency_key = "refund"

        def run(self) -> None: ...

    app.register_task(Refund())
    own_tasks(app, "names.")
    # And a kit test that keeps a helper's report in a variable called report, and runs a worker
    text = (
        "from celery_guardrails.testing import deliver_twice\n\n\n"
        "def test_charge(worker):\n    report = deliver_twice(charge)\n    worker.run()\n    assert report.task_id\n"
    )
    write_tree(tmp_path, {"tests/test_charge.py": text})
    # Then neither task is named by it
    assert [(f.code, f.subject) for f in audit(app, source=tmp_path).findings if f.axis == "tests"] == [
        ("GA802", "names.refund"),
        ("GA802", "names.report"),
    ]
    # When another kit test imports the class, and names the decorated task by its name
    text = (
        "from celery_guardrails.testing import poison\nfrom shop.tasks import Refund\n\n\n"
        'def test_both():\n    poison(Refund)\n    poison("names.report")\n'
    )
    write_tree(tmp_path, {"tests/test_both.py": text})
    # Then both are named
    assert [f for f in audit(app, source=tmp_path).findings if f.axis == "tests"] == []


@pytest.mark.parametrize(
    "text",
    [
        "from celery_guardrails.testing import deliver_twice\n",
        "import celery_guardrails.testing.kit\n",
        "from celery_guardrails import testing\n",
        'pytest_plugins = ["celery_guardrails.testing"]\n',
        "import pytest\npytestmark = pytest.mark.guardrails\n",
        "def test_x(guarded_worker):\n    pass\n",
        'import pytest\n@pytest.mark.usefixtures("guardrails_kit")\ndef test_x():\n    pass\n',
    ],
)
def test_each_way_of_using_the_kit_counts(tmp_path: Path, text: str) -> None:
    # Given a test file that uses the kit in one of the ways its plugin is enabled
    write_tree(tmp_path, {"tests/test_a.py": text})
    # When the tests are read
    count, kit_files = audit_source.read_tests(audit_source.walk(tmp_path))
    # Then it is a kit file
    assert (count, [kit_file.path for kit_file in kit_files]) == (1, ["tests/test_a.py"])


def test_the_kit_names_the_audit_looks_for_are_the_kit_s() -> None:
    # Given the test kit's public helpers, fixtures and marker
    helpers = {name for name in celery_guardrails.testing.__all__ if name[0].islower() and name != "current_kit"}
    # Then the audit knows them all
    assert set(audit_source.KIT_HELPERS) == helpers
    assert all(callable(getattr(celery_guardrails.testing.plugin, name)) for name in audit_source.KIT_FIXTURES)
    assert audit_source.KIT_MARKER == entry.MARKER
    assert celery_guardrails.testing.__name__ == audit_source.KIT_MODULE


def test_the_tests_are_looked_for_beside_a_base_dir_that_has_none(settings: Any, tmp_path: Path) -> None:
    # Given a Django project whose BASE_DIR holds no test, in a repository whose tests/ sits beside it
    write_tree(tmp_path, {"proj/shop/views.py": "", "tests/test_shop.py": kit_test("charge")})
    settings.BASE_DIR = tmp_path / "proj"
    # When the audit finds its folders
    from celery_guardrails.operations.audit import source_walks

    code, tests = source_walks()
    # Then the code is BASE_DIR's, the tests its parent's
    assert (code.root, tests.root) == (tmp_path / "proj", tmp_path)
    # And once BASE_DIR has tests of its own, they are the ones read
    write_tree(tmp_path, {"proj/shop/tests.py": ""})
    code, tests = source_walks()
    assert (code.root, tests.root) == (tmp_path / "proj", tmp_path / "proj")
    # And an explicit source is read as it is given
    assert [walk.root for walk in source_walks(tmp_path / "proj" / "shop")] == [tmp_path / "proj" / "shop"] * 2


def test_the_scan_is_bounded_and_says_so(tmp_path: Path) -> None:
    # Given a tree of more Python files than a walk reads
    write_tree(tmp_path, {f"pkg/m{n}.py": "" for n in range(5)})
    # When it is walked with a bound of 3 files, or 2 folders
    files = audit_source.walk(tmp_path, max_files=3)
    folders = audit_source.walk(tmp_path, max_folders=1)
    # Then it stops, says why, and keeps what it read
    assert (files.complete, files.why_incomplete, files.files) == (
        False,
        "over 3 Python files",
        ("pkg/m0.py", "pkg/m1.py", "pkg/m2.py"),
    )
    assert (folders.complete, folders.why_incomplete) == (False, "over 1 folders")
    # And an audit whose source is not a folder says what it did not read, at no cost
    report = audit(good_app(), source=tmp_path / "nowhere")
    assert [(f.code, f.severity) for f in report.findings if f.code in ("GA009", "GA809")] == [
        ("GA009", "info"),
        ("GA809", "info"),
    ]


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
