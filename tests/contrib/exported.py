"""What the contrib files may name: the metric names the project really exports, and the names a PromQL
expression uses.

:func:`scrape` reads them from a real registry (the worker-side metrics of this process plus a
:class:`~celery_guardrails.operations.collectors.StateCollector` of the app), the way an exporter serves them, rather
than
from a list kept by hand that could drift from the code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from celery_guardrails.operations import metrics
from celery_guardrails.operations.collectors import StateCollector

#: The series names a family of each type exposes, by suffix (prometheus_client's family name has no
#: ``_total``; a family without samples yet still says what its samples will be called).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


@dataclass(frozen=True, kw_only=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, kw_only=True)
class Scrape:
    """One scrape: every series name the families expose, and their samples."""

    names: frozenset[str]
    samples: tuple[Sample, ...]


def scrape(app: Any) -> Scrape:
    """Scrape this process's metrics (:func:`celery_guardrails.operations.metrics.metrics_registry`) and a
    :class:`StateCollector` of ``app``, as the worker endpoint and the Django view serve them."""
    registry = metrics.metrics_registry()
    collector_registry = CollectorRegistry(auto_describe=False)
    collector_registry.register(StateCollector(app))
    families = [*registry.collect(), *collector_registry.collect()]
    names = {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}
    samples = [
        Sample(name=sample.name, labels=dict(sample.labels), value=sample.value)
        for family in families
        for sample in family.samples
    ]
    names.update(sample.name for sample in samples)
    return Scrape(names=frozenset(names), samples=tuple(samples))


# PromQL words that are not metric names (set operators, modifiers, special values).
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"inf", "nan", "atan2", "start", "end"}
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLES = re.compile(r"\$(?:\{[^}]*\}|\w+)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKENS = re.compile(r"(?P<number>\d[\w.]*(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_:][\w:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: the identifiers that are not functions, keywords, label names
    (in matchers or grouping clauses), strings, numbers, durations, or Grafana variables."""
    text = _STRINGS.sub('""', expr)
    text = _GRAFANA_VARIABLES.sub("1m", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for token in _TOKENS.finditer(text):
        name = token.group("name")
        if name is None or name.lower() in _KEYWORDS:
            continue
        if text[token.end() :].lstrip().startswith("("):
            continue  # a function (or an aggregation written without a grouping clause)
        names.add(name)
    return names


def unknown_names(exprs: Iterable[str], exported: Iterable[str]) -> dict[str, set[str]]:
    """Per expression, the metric names it uses that are not in ``exported`` (empty: all known)."""
    known = set(exported)
    return {expr: missing for expr in exprs if (missing := metric_names(expr) - known)}
