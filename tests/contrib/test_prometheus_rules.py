"""contrib/prometheus/celery-guardrails-rules.yml: its shape, the metric names it uses (against a real scrape
of a real worker and the state collector), and, with promtool, that Prometheus accepts it and that its alerts
fire (and stay quiet) as they say, on the series a real scrape produced and on crafted ones.

promtool comes from Debian's prometheus package (``make services`` installs it as root): a test that needs it
skips locally without it and fails with ``CI`` set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.contrib.conftest import DEPENDENCY, OWNER, contrib_fails
from tests.contrib.exported import Sample, Scrape, metric_names, unknown_names

RULES = Path(__file__).resolve().parents[2] / "contrib" / "prometheus" / "celery-guardrails-rules.yml"
SEVERITIES = {"warning", "critical"}
#: Seconds promtool may take: it is a local process reading two small files.
PROMTOOL_TIMEOUT = 120


def load() -> dict[str, Any]:
    with RULES.open() as file:
        loaded = yaml.safe_load(file)
    assert isinstance(loaded, dict), "the rules file is a mapping"
    return loaded


def rules() -> list[dict[str, Any]]:
    return [rule for group in load()["groups"] for rule in group["rules"]]


def promtool() -> str:
    """The promtool executable; skips (locally) or fails (CI) when it is not installed."""
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool is not installed; `make services` (as root) installs Debian's prometheus package"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure)", pytrace=False)
    pytest.skip(message)


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT, check=False
    )


def kept_labels(expr: str) -> set[str]:
    """The labels an expression's aggregations keep (every ``by (...)`` clause)."""
    return {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}


# The file's shape (PyYAML only)


def test_every_group_has_a_name_and_rules() -> None:
    # Given the rules file
    groups = load()["groups"]

    # Then every group has a unique name and at least one rule
    assert groups
    names = [group.get("name") for group in groups]
    assert all(isinstance(name, str) and name for name in names)
    assert len(set(names)) == len(names)
    for group in groups:
        assert group.get("rules"), f"group {group['name']} has no rules"


def test_every_rule_is_an_alert_or_a_record_with_an_expression() -> None:
    for rule in rules():
        # Then each is exactly one of alert / record, with a non-empty expr, and no key Prometheus does not know
        assert ("alert" in rule) != ("record" in rule), rule
        assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), rule
        assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
        if "record" in rule:
            # level:metric:operations, the recording rules' naming convention; no for/annotations on a record
            assert re.fullmatch(r"celery_guardrails:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
            assert not {"for", "annotations"} & set(rule), rule


def test_every_alert_has_a_for_a_severity_and_a_summary() -> None:
    alerts = [rule for rule in rules() if "alert" in rule]
    assert alerts
    for alert in alerts:
        # Then each waits a stated time (a missed run fires at once: "0m", but said)...
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), alert["alert"]
        # ... has a severity Alertmanager can route on, and a summary and a description
        assert alert.get("labels", {}).get("severity") in SEVERITIES, alert["alert"]
        assert alert.get("annotations", {}).get("summary"), alert["alert"]
        assert alert.get("annotations", {}).get("description"), alert["alert"]


def test_annotations_name_only_labels_the_expression_keeps() -> None:
    for alert in (rule for rule in rules() if "alert" in rule):
        # Given the labels the expression's aggregations keep (by (...))
        kept = kept_labels(alert["expr"])
        # Then every {{ $labels.x }} of its annotations is one of them (else it renders empty)
        used = {name for text in alert["annotations"].values() for name in re.findall(r"\$labels\.(\w+)", text)}
        assert used <= kept, (alert["alert"], used - kept)


def test_the_alerts_the_brief_asks_for_are_there() -> None:
    # Then the alerts cover dead letters (routed by owner), queue age, schedules, budgets, circuits, sources
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    assert {
        "CeleryGuardrailsDeadLettersOpen",
        "CeleryGuardrailsQueueOldestMessageOld",
        "CeleryGuardrailsScheduleMissedRun",
        "CeleryGuardrailsScheduleNoRecentSuccess",
        "CeleryGuardrailsRetryBudgetSpent",
        "CeleryGuardrailsCircuitOpen",
        "CeleryGuardrailsCollectorSourceDown",
        "CeleryGuardrailsOutboxRelayLagging",
    } <= set(alerts)
    assert "owner" in kept_labels(alerts["CeleryGuardrailsDeadLettersOpen"]["expr"])


def test_the_promql_name_reader_sees_what_it_should() -> None:
    # Given expressions with functions, matchers, grouping, offsets, strings and Grafana variables
    expr = (
        'label_replace(max by (owner, task) (a_total{x="y"}), "owner", "u", "owner", "") > 0 '
        "and on (queue) b offset 30m or histogram_quantile(0.95, sum by (le) (rate(c_bucket[$__rate_interval])))"
    )
    # Then only the selected metrics are read as names
    assert metric_names(expr) == {"a_total", "b", "c_bucket"}
    assert metric_names("sum(rate(d[5m])) by (task) / ignoring(x) e") == {"d", "e"}


# The metric names, against a real scrape


def test_every_metric_the_rules_use_is_exported(real_scrape: Scrape) -> None:
    # Given the series names a real worker (metrics on, after a success and a dead letter) and the state
    # collector export, and the names the file's own recording rules define
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    known = real_scrape.names | recorded

    # When every expression's metric names are read
    missing = unknown_names((rule["expr"] for rule in rules()), known)

    # Then each is one of them (a typo or a renamed metric would make an alert that can never fire)
    assert not missing, missing
    # ... and the scrape did include the families the alerts are about
    used = {name for rule in rules() for name in metric_names(rule["expr"])}
    assert {
        "celery_guardrails_dead_letters_open",
        "celery_guardrails_queue_oldest_age_seconds",
        "celery_guardrails_schedule_missed_runs",
        "celery_guardrails_circuit_state",
        "celery_guardrails_collector_source_up",
    } <= used


# promtool


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    # When promtool checks the file (syntax, PromQL, templates)
    result = run_promtool("check", "rules", str(RULES), cwd=tmp_path)

    # Then it is valid
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def series(sample: Sample) -> str:
    labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
    return f"{sample.name}{{{labels}}}"


def unit_test(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """Run ``promtool test rules`` with ``tests`` over the shipped rules file."""
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    document = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(document, sort_keys=False))
    return run_promtool("test", "rules", "tests.yml", cwd=tmp_path)


def alert(name: str, severity: str = "warning", **labels: str) -> dict[str, Any]:
    """An exp_samples entry: the ALERTS series of a firing alert."""
    every = {"alertname": name, "alertstate": "firing", "severity": severity, **labels}
    return {"labels": "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in every.items()) + "}", "value": 1}


def test_a_real_dead_letter_fires_the_owners_alert_and_nothing_else(real_scrape: Scrape, tmp_path: Path) -> None:
    # Given the state gauges a real scrape gave for this test's owner, dependency and sources (a real dead
    # letter of OWNER's task, its dependency's closed circuit and unspent budget), held for 20 minutes
    promtool()
    ours = [
        sample
        for sample in real_scrape.samples
        if sample.labels.get("owner") == OWNER
        or sample.labels.get("dependency") == DEPENDENCY
        or sample.name == "celery_guardrails_collector_source_up"
    ]
    assert any(sample.name == "celery_guardrails_dead_letters_open" for sample in ours), ours
    input_series = [{"series": series(sample), "values": f"{sample.value:g}x20"} for sample in ours]

    # When Prometheus's rule engine evaluates the rules over them
    result = unit_test(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": input_series,
                "promql_expr_test": [
                    # Then at once nothing fires (the dead letter's alert waits its for: 1m)
                    {"expr": 'ALERTS{alertstate="firing"}', "eval_time": "0m", "exp_samples": []},
                    # ... and after it, exactly the dead letter's alert fires, with the owner to route on
                    {
                        "expr": 'ALERTS{alertstate="firing"}',
                        "eval_time": "10m",
                        "exp_samples": [alert("CeleryGuardrailsDeadLettersOpen", owner=OWNER, task=contrib_fails.name)],
                    },
                ],
            }
        ],
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_alert_fires_past_its_threshold_and_only_then(tmp_path: Path) -> None:
    # Given crafted series on both sides of each threshold (minute by minute)
    promtool()
    input_series = [
        # two replicas of the Django view scraped: a count is taken once (max), not doubled
        {"series": 'celery_guardrails_dead_letters_open{owner="",task="t.orphan",instance="a"}', "values": "2x40"},
        {"series": 'celery_guardrails_dead_letters_open{owner="",task="t.orphan",instance="b"}', "values": "2x40"},
        {"series": 'celery_guardrails_dead_letters_open{owner="ops",task="t.fine",instance="a"}', "values": "0x40"},
        # queue "slow": 400 s old; "fast": 10 s; "plain": unknown (no age sample, known 0)
        {"series": 'celery_guardrails_queue_oldest_age_seconds{queue="slow"}', "values": "400+60x40"},
        {"series": 'celery_guardrails_queue_oldest_age_known{queue="slow"}', "values": "1x40"},
        {"series": 'celery_guardrails_queue_oldest_age_seconds{queue="fast"}', "values": "10x40"},
        {"series": 'celery_guardrails_queue_oldest_age_known{queue="fast"}', "values": "1x40"},
        {"series": 'celery_guardrails_queue_oldest_age_known{queue="plain"}', "values": "0x40"},
        # a budget spent, another not; a circuit open, another closed
        {"series": 'celery_guardrails_retry_budget_retries{dependency="pay"}', "values": "10x40"},
        {"series": 'celery_guardrails_retry_budget_allowed{dependency="pay"}', "values": "10x40"},
        {"series": 'celery_guardrails_retry_budget_retries{dependency="mail"}', "values": "3x40"},
        {"series": 'celery_guardrails_retry_budget_allowed{dependency="mail"}', "values": "10x40"},
        {"series": 'celery_guardrails_circuit_state{dependency="pay",state="open"}', "values": "1x40"},
        {"series": 'celery_guardrails_circuit_state{dependency="pay",state="closed"}', "values": "0x40"},
        {"series": 'celery_guardrails_circuit_state{dependency="mail",state="open"}', "values": "0x40"},
        {"series": 'celery_guardrails_circuit_state{dependency="mail",state="closed"}', "values": "1x40"},
        # the schedules source cannot be read; the queues source can
        {"series": 'celery_guardrails_collector_source_up{source="schedules"}', "values": "0x40"},
        {"series": 'celery_guardrails_collector_source_up{source="queues"}', "values": "1x40"},
        # "nightly" last succeeded 26 h ago; "hourly" 30 min ago
        {"series": 'celery_guardrails_schedule_last_success_age_seconds{schedule="nightly"}', "values": "93600+60x40"},
        {"series": 'celery_guardrails_schedule_last_success_age_seconds{schedule="hourly"}', "values": "1800x40"},
        # the outbox's oldest message: waiting since minute 0 (its age grows a minute a minute), two views scraped
        {"series": 'celery_guardrails_outbox_oldest_age_seconds{instance="a"}', "values": "0+60x40"},
        {"series": 'celery_guardrails_outbox_oldest_age_seconds{instance="b"}', "values": "0+60x40"},
    ]
    firing_at_20m = [
        alert("CeleryGuardrailsDeadLettersOpen", owner="unowned", task="t.orphan"),
        alert("CeleryGuardrailsQueueOldestMessageOld", queue="slow"),
        alert("CeleryGuardrailsRetryBudgetSpent", dependency="pay"),
        alert("CeleryGuardrailsCircuitOpen", dependency="pay"),
        alert("CeleryGuardrailsCollectorSourceDown", source="schedules"),
        alert("CeleryGuardrailsScheduleNoRecentSuccess", schedule="nightly"),
        # past 300 s at minute 6, firing from minute 11
        alert("CeleryGuardrailsOutboxRelayLagging"),
    ]
    # "slow" passes 1800 s at minute 24 (400 + 60 * 24 > 1800); the critical one fires 5 minutes later
    firing_at_35m = [*firing_at_20m, alert("CeleryGuardrailsQueueOldestMessageOld", "critical", queue="slow")]

    # When the rules are evaluated over them
    result = unit_test(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": input_series,
                "promql_expr_test": [
                    # Then before the for: durations pass, nothing fires
                    {"expr": 'ALERTS{alertstate="firing"}', "eval_time": "0m", "exp_samples": []},
                    # ... then each alert past its threshold, and none of those below it or with an unknown age
                    {"expr": 'ALERTS{alertstate="firing"}', "eval_time": "20m", "exp_samples": firing_at_20m},
                    {"expr": 'ALERTS{alertstate="firing"}', "eval_time": "35m", "exp_samples": firing_at_35m},
                ],
            },
            {
                "interval": "1m",
                # a schedule missed one run at minute 40 (after 40 minutes at 2 from older misses), and one
                # that had missed runs before it was first scraped
                "input_series": [
                    {"series": 'celery_guardrails_schedule_missed_runs{schedule="daily"}', "values": "2x40 3x80"},
                    {"series": 'celery_guardrails_schedule_missed_runs{schedule="new"}', "values": "_x60 1x60"},
                    # a gauge that falls (a miss leaving the 7-day window) is no new miss
                    {"series": 'celery_guardrails_schedule_missed_runs{schedule="aging"}', "values": "2x40 1x80"},
                ],
                "promql_expr_test": [
                    {
                        "expr": 'ALERTS{alertname="CeleryGuardrailsScheduleMissedRun"}',
                        "eval_time": "39m",
                        "exp_samples": [],
                    },
                    {
                        "expr": 'ALERTS{alertname="CeleryGuardrailsScheduleMissedRun"}',
                        "eval_time": "45m",
                        "exp_samples": [alert("CeleryGuardrailsScheduleMissedRun", schedule="daily")],
                    },
                    # ("daily" still fires at 65m: its miss is not 30 minutes old yet)
                    {
                        "expr": 'ALERTS{alertname="CeleryGuardrailsScheduleMissedRun"}',
                        "eval_time": "75m",
                        "exp_samples": [alert("CeleryGuardrailsScheduleMissedRun", schedule="new")],
                    },
                    # ... and once 30 minutes have passed without a new miss, it resolves
                    {
                        "expr": 'ALERTS{alertname="CeleryGuardrailsScheduleMissedRun"}',
                        "eval_time": "100m",
                        "exp_samples": [],
                    },
                ],
            },
        ],
    )
    assert result.returncode == 0, result.stdout + result.stderr
