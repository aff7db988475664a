"""contrib/grafana/celery-guardrails-dashboard.json: valid JSON Grafana 10/11 imports, unique panel ids, a
PromQL expression on every target, the datasource/queue/task variables, the panels the metrics are for, and
only metric names a real worker and the state collector export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.contrib.exported import Scrape, metric_names, unknown_names

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "celery-guardrails-dashboard.json"
#: Grafana 10.0 writes schemaVersion 38, 11.x 39 and up; older ones migrate it on import, newer ones too.
MIN_SCHEMA_VERSION = 38
#: label_values(metric{matchers}, label): Grafana's variable query, not PromQL.
LABEL_VALUES = re.compile(r"label_values\((?P<selector>[^,]+),\s*(?P<label>\w+)\)")


def load() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [target for panel in panels(dashboard) for target in panel.get("targets", [])]


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query")
    return str(query.get("query", "")) if isinstance(query, dict) else str(query or variable.get("definition", ""))


def test_the_dashboard_is_json_grafana_imports() -> None:
    # Given the file
    dashboard = load()

    # Then it has a title, a stable uid (so re-imports update it) and a recent schema, no instance-specific id
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard["schemaVersion"] >= MIN_SCHEMA_VERSION
    assert dashboard.get("id") is None


def test_panel_ids_are_unique_and_panels_lie_on_the_grid() -> None:
    every = panels(load())
    ids = [panel["id"] for panel in every]
    # Then no two panels share an id (Grafana would drop or mix them)
    assert len(ids) == len(set(ids)), ids
    for panel in every:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, panel["title"]


def test_every_target_has_a_promql_expression_on_the_chosen_datasource() -> None:
    for panel in panels(load()):
        if panel["type"] == "row":
            continue
        # Then every non-row panel queries, each target with an expr, a refId unique in its panel
        assert panel.get("targets"), panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert isinstance(target.get("expr"), str) and target["expr"].strip(), panel["title"]
            # ... on the datasource variable, never a data source of the machine it was made on
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_the_datasource_queue_and_task_variables_are_there() -> None:
    found = variables(load())
    # Then a Prometheus data source variable, and queue and task from label_values
    assert found["datasource"]["type"] == "datasource" and found["datasource"]["query"] == "prometheus"
    for name, label in (("queue", "queue"), ("task", "task")):
        variable = found[name]
        assert variable["type"] == "query"
        match = LABEL_VALUES.fullmatch(variable_query(variable))
        assert match and match["label"] == label, variable_query(variable)
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        # ... whose "All" matches every value (a regex, as the panels use them with =~)
        assert variable["includeAll"] and variable["allValue"] == ".*"
    # ... and the panels use them
    exprs = " ".join(target["expr"] for target in targets(load()))
    assert 'queue=~"$queue"' in exprs and 'task=~"$task"' in exprs


def test_the_panels_cover_what_the_metrics_are_for() -> None:
    # Given what each panel queries
    dashboard = load()
    by_title = {panel["title"]: panel for panel in panels(dashboard)}
    used = {title: " ".join(target["expr"] for target in panel.get("targets", [])) for title, panel in by_title.items()}

    # Then the dashboard shows queue depth and age, arrival vs throughput, duration percentiles, outcomes
    # stacked, queue wait p95, open dead letters as a table, budgets, circuits and schedule health
    assert "celery_guardrails_queue_depth" in used["Queue depth"]
    assert "celery_guardrails_queue_oldest_age_seconds" in used["Oldest message age"]
    assert "messages_published_total" in used["Arrival vs throughput"]
    assert "messages_completed_total" in used["Arrival vs throughput"]
    assert used["Duration percentiles per task"].count("histogram_quantile(") == 3
    assert "task_duration_seconds_bucket" in used["Duration percentiles per task"]
    assert "task_outcomes_total" in used["Outcomes per task"]
    stacking = by_title["Outcomes per task"]["fieldConfig"]["defaults"]["custom"]["stacking"]
    assert stacking["mode"] == "normal"
    assert "histogram_quantile(0.95" in used["Queue wait p95"]
    assert by_title["Open dead letters by owner and task"]["type"] == "table"
    assert "by (owner, task)" in used["Open dead letters by owner and task"]
    assert "retry_budget_retries" in used["Retry budget use"] and "retry_budget_allowed" in used["Retry budget use"]
    assert 'state="open"' in used["Circuit state per dependency"]
    assert {"schedule_missed_runs", "schedule_overdue_runs", "schedule_last_success_age_seconds"} <= {
        name.removeprefix("celery_guardrails_") for name in metric_names(used["Schedule health"])
    }


def test_every_metric_the_dashboard_uses_is_exported(real_scrape: Scrape) -> None:
    # Given the series names a real worker (metrics on, after a success and a dead letter) and the state
    # collector export
    dashboard = load()

    # When every panel expression's metric names, and every variable's metric, are read
    exprs = [target["expr"] for target in targets(dashboard)]
    missing = unknown_names(exprs, real_scrape.names)
    for variable in variables(dashboard).values():
        match = LABEL_VALUES.fullmatch(variable_query(variable))
        if match:
            missing.update(unknown_names([match["selector"]], real_scrape.names))

    # Then each is one of them (a panel on a name nobody exports stays empty for ever)
    assert not missing, missing
    # ... and every family the project exports shows somewhere (the dashboard misses none)
    used = {name for expr in exprs for name in metric_names(expr)}
    families = {
        name.removesuffix("_bucket").removesuffix("_total")
        for name in used | {sample.name for sample in real_scrape.samples}
        if name.startswith("celery_guardrails_")
    }
    shown = {name.removesuffix("_bucket").removesuffix("_total") for name in used}
    assert families - shown <= {
        # counted for the alert on the scrape, not charted: the up/down panel shows the same
        "celery_guardrails_collector_errors",
        # histogram parts the percentiles do not need
        "celery_guardrails_task_duration_seconds_sum",
        "celery_guardrails_task_duration_seconds_count",
        "celery_guardrails_task_queue_wait_seconds_sum",
        "celery_guardrails_task_queue_wait_seconds_count",
    } | {name for name in families if name.endswith("_created")}, families - shown
