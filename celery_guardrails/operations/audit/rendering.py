"""The report as the commands print it: :func:`render` as text (per axis its score and findings, each with its
fix; the average; the folders read; the verdict against the threshold) and :func:`as_json` (the report's
fields, the threshold and whether it passed), for ``celery -A proj guardrails audit`` and ``manage.py
guardrails_audit``.
"""

from __future__ import annotations

import json

from celery_guardrails.operations.audit.model import MIN_AVERAGE, MIN_SCORE, TOP, Report


def render(report: Report, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> str:
    """The report as text: per axis its score and findings, each with its fix; the average; then the verdict."""
    lines = []
    for axis in report.axes:
        lines.append(f"{axis.title}: {axis.score}/{TOP}")
        for finding in axis.findings:
            lines.append(f"  {finding.code} {finding.severity:<7} {finding.subject}: {finding.message}")
            lines.append(f"        fix: {finding.fix}")
    lines.append(f"average: {report.average:.2f}/{TOP} over {len(report.axes)} axes")
    if report.source is not None:
        tests = "" if report.tests_source == report.source else f"; tests read under {report.tests_source}"
        lines.append(f"source read under {report.source}{tests}")
    failures = report.failures(min_score=min_score, min_average=min_average)
    if failures:
        lines.append("FAIL: " + "; ".join(failures))
    else:
        lines.append(
            f"OK: every axis scores {min_score} or more (lowest {report.lowest}), and the average "
            f"{report.average:.2f} is {min_average} or more"
        )
    return "\n".join(lines)


def as_json(report: Report, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> str:
    """The report as JSON, with the threshold and whether it passed."""
    data = report.as_dict()
    data["min_score"] = min_score
    data["min_average"] = min_average
    data["passed"] = report.passed(min_score=min_score, min_average=min_average)
    return json.dumps(data, indent=2)
