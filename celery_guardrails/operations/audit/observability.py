"""The observability axis (GA7xx): whether the deployment can be watched. Prometheus ``metrics`` off, or on with
no prometheus-client to record them; ``activity`` off (no last day of outcomes for the dashboard and the status
rates).
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations.audit.model import WARNING, Finding, finding
from celery_guardrails.options import app_value


def observability_rules(app: Any) -> list[Finding]:
    """Observability (GA7xx): metrics off or not installed, activity off."""
    found = []
    if not app_value(app, "metrics"):
        found.append(
            finding(
                "GA701",
                WARNING,
                "metrics",
                "metrics is off: no Prometheus metrics (durations, outcomes, queue wait, arrivals against throughput)",
                "set metrics=True (the prometheus extra) and scrape metrics_port or the Django view",
            )
        )
    else:
        from celery_guardrails.operations import metrics

        if not metrics.available():
            found.append(
                finding(
                    "GA703",
                    WARNING,
                    "metrics",
                    "metrics is on but prometheus-client is not installed: nothing is recorded",
                    "pip install 'celery-guardrails[prometheus]'",
                )
            )
    if not app_value(app, "activity"):
        found.append(
            finding(
                "GA702",
                WARNING,
                "activity",
                "activity is off: no last day of outcomes and queue samples for the dashboard and the status rates",
                "remove activity=False",
            )
        )
    return found
