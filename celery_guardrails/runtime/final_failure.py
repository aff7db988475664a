"""``FinalFailure``: everything known about a message that will not be tried again, as its dead letter stores it.

A value and nothing else: :mod:`celery_guardrails.runtime.outcomes` builds one as a delivery fails finally, and
:mod:`celery_guardrails.runtime.dead_letters` writes it to the sinks. Kept apart from both so that neither
imports the other (the writer needs the shape, not the ways a delivery ends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalFailure:
    """Everything known about a message that will not be tried again (what a dead letter stores)."""

    task_name: str
    task_id: str
    reason: str
    exc_type: str
    exc_message: str
    tenant: str | None
    correlation_id: str | None
    attempts: int
    history: list[dict[str, Any]] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None
    owner: str | None = None
    idempotency_key: str | None = None
    header: dict[str, Any] = field(default_factory=dict)
    traceback: str = ""
    first_failed_at: str = ""
    last_failed_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "args": list(self.args)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FinalFailure:
        """A failure read back from a message header: fields of the wrong type are taken as missing (the
        header checked the ones it needs; the rest came from a release that may differ, or from tampering)."""
        kinds: dict[str, tuple[type, Any]] = {
            "tenant": (str, None),
            "correlation_id": (str, None),
            "attempts": (int, 1),
            "history": (list, []),
            "args": (list, ()),
            "kwargs": (dict, {}),
            "queue": (str, None),
            "owner": (str, None),
            "idempotency_key": (str, None),
            "header": (dict, {}),
        }
        values: dict[str, Any] = {}
        for spec in fields(cls):
            value = data.get(spec.name)
            kind, default = kinds.get(spec.name, (str, ""))
            values[spec.name] = value if isinstance(value, kind) and not isinstance(value, bool) else default
        values["history"] = [r for r in values["history"] if isinstance(r, dict)]
        return cls(**values)
