"""What the test kit hands back and takes: a :class:`Captured` message (as the task's ``apply_async`` published
it, to be sent again as is), the :class:`Report` of one helper call (each message's deliveries and how they
ended, read from the worker's event log), a :class:`Release` (one side of a deployment), and the
:class:`KitError` a helper raises when it cannot do what it was asked or sees the handler fail the test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_guardrails.testing import events


class KitError(AssertionError):
    """A helper could not do what it was asked, or saw the handler fail the test: the message says which,
    with what the worker did."""


@dataclass
class Captured:
    """A message as the task's ``apply_async`` published it: sent again as is, it is the same message."""

    task_id: str
    task_name: str
    body: Any
    headers: dict[str, Any]
    properties: dict[str, Any]


@dataclass
class Report:
    """What the worker did with the messages of one helper call."""

    task_ids: list[str]
    messages: dict[str, events.Message]
    #: Times the worker was killed during the call (by the plan or by the kit).
    crashes: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return self.task_ids[0]

    def of(self, task_id: str | None = None) -> events.Message:
        found = task_id or self.task_id
        return self.messages.get(found) or events.Message(found)

    @property
    def deliveries(self) -> int:
        """Deliveries started, over all the call's messages."""
        return sum(self.of(task_id).starts for task_id in self.task_ids)

    @property
    def outcomes(self) -> list[tuple[str, str]]:
        """How each delivery ended (outcome, detail), over all the call's messages, in order."""
        return [outcome for task_id in self.task_ids for outcome in self.of(task_id).outcomes]

    @property
    def order(self) -> list[int]:
        """The positions (in the order given) of the messages, in the order their bodies succeeded."""
        position = {task_id: index for index, task_id in enumerate(self.task_ids)}
        return [position[task_id] for task_id in self.details.get("succeeded_order", []) if task_id in position]


@dataclass
class Release:
    """One side of a deployment: what its publishers send, and the code its workers run.

    ``messages``: each an argument tuple, a keyword dict, or an ``(args, kwargs)`` pair. ``version``: the
    payload version its publishers stamp (the header field ``pv``; None: the task's own ``payload_version``).
    ``app``: the Celery app its workers run, as ``celery -A`` takes it (None: the kit's)."""

    messages: Sequence[Any]
    version: int | None = None
    app: str | None = None


def split_arguments(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A message given to a helper as its (args, kwargs): an argument tuple or list, a keyword dict, an
    ``(args, kwargs)`` pair, or a single argument."""
    if isinstance(item, dict):
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple | list) and isinstance(item[1], dict):
        return tuple(item[0]), dict(item[1])
    if isinstance(item, tuple | list):
        return tuple(item), {}
    return (item,), {}
