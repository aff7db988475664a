"""The audit's findings and scores: a :class:`Finding` names one thing to change (a stable code whose first digit is
its axis, a severity, the task, setting, beat entry or file it is about, and its fix); :func:`report_of` scores
the nine axes of the rubric from the findings (2 points an error, 1 a warning, 0 an info, the zero rule for a
handler retried while not idempotent) into a :class:`Report`, the one value every rule module, the renderers,
the commands and the Django checks share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"
#: Points a finding costs its axis.
COST = {ERROR: 2, WARNING: 1, INFO: 0}
#: The top score of an axis.
TOP = 5
#: The rubric's threshold: no axis below MIN_SCORE, and an average of at least MIN_AVERAGE.
MIN_SCORE = 3
MIN_AVERAGE = 4.0

#: The axes, in the rubric's order: (name, title). A code's first digit is its axis' index here.
AXES = (
    ("placement", "placement"),
    ("message_design", "message design"),
    ("idempotency", "idempotency enforced"),
    ("retry_policy", "retry policy with classification"),
    ("dead_letters", "dead-letter ownership"),
    ("ordering_concurrency", "ordering and concurrency"),
    ("scheduled_work", "scheduled work"),
    ("observability", "observability"),
    ("tests", "tests"),
)
TITLES = dict(AXES)
#: The axis of each code's first digit.
AXIS_OF_DIGIT = {str(number): name for number, (name, _) in enumerate(AXES)}
#: The zero rule: a handler retried while not idempotent scores its axis 0, whatever else is right.
ZERO_RULE = frozenset({"GA301", "GA305"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One thing to change: ``subject`` is the task, setting, beat entry or source file it names."""

    code: str
    axis: str
    severity: str
    subject: str
    message: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Axis:
    """One axis of the rubric: its score (0 to 5) and the findings that cost it points."""

    name: str
    score: int
    findings: tuple[Finding, ...] = ()

    @property
    def title(self) -> str:
        return TITLES[self.name]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "score": self.score,
            "findings": [finding.as_dict() for finding in self.findings],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Every axis, in the rubric's order, and every finding; where the source and the tests were read."""

    axes: tuple[Axis, ...]
    findings: tuple[Finding, ...] = field(default=())
    source: str | None = None
    tests_source: str | None = None

    @property
    def lowest(self) -> int:
        return min(axis.score for axis in self.axes)

    @property
    def average(self) -> float:
        return sum(axis.score for axis in self.axes) / len(self.axes)

    def below(self, threshold: int) -> list[Axis]:
        """The axes that score below ``threshold``."""
        return [axis for axis in self.axes if axis.score < threshold]

    def failures(self, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> list[str]:
        """Why the report misses the threshold (an axis below ``min_score``, the average below ``min_average``);
        empty when it passes."""
        failed = []
        below = self.below(min_score)
        if below:
            failed.append(f"below {min_score}: " + ", ".join(f"{axis.title} {axis.score}" for axis in below))
        if self.average < min_average:
            failed.append(f"average {self.average:.2f} below {min_average}")
        return failed

    def passed(self, *, min_score: int = MIN_SCORE, min_average: float = MIN_AVERAGE) -> bool:
        return not self.failures(min_score=min_score, min_average=min_average)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lowest": self.lowest,
            "average": round(self.average, 2),
            "source": self.source,
            "tests_source": self.tests_source,
            "axes": [axis.as_dict() for axis in self.axes],
            "findings": [finding.as_dict() for finding in self.findings],
        }


def finding(code: str, severity: str, subject: str, message: str, fix: str) -> Finding:
    """A finding, its axis read from its code's first digit (GA3xx: the fourth axis, retry policy)."""
    return Finding(code=code, axis=AXIS_OF_DIGIT[code[2]], severity=severity, subject=subject, message=message, fix=fix)


def report_of(findings: Iterable[Finding], *, source: str | None = None, tests_source: str | None = None) -> Report:
    """Score the axes of ``findings`` (see the package docstring for the rule, the zero rule included)."""
    found = tuple(sorted(findings, key=lambda f: (f.code, f.subject)))
    axes = []
    for name, _ in AXES:
        mine = tuple(f for f in found if f.axis == name)
        score = max(0, TOP - sum(COST[f.severity] for f in mine))
        if any(f.code in ZERO_RULE for f in mine):
            score = 0
        axes.append(Axis(name=name, score=score, findings=mine))
    return Report(axes=tuple(axes), findings=found, source=source, tests_source=tests_source)
