"""The kit of the test that is running: set by the ``guardrails_kit`` fixture (:mod:`.plugin`), read by the
module-level helpers of :mod:`celery_guardrails.testing` and by the assertions (which import this, not the
package, so that the package and its assertions do not import each other)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_guardrails.testing.kit import KitError

if TYPE_CHECKING:
    from celery_guardrails.testing.kit import Kit

_current: Kit | None = None


def set_current(kit: Kit | None) -> None:
    """Make ``kit`` the running test's kit (None: no test kit is running)."""
    global _current
    _current = kit


def running_kit() -> Kit | None:
    """The running test's kit, or None."""
    return _current


def current_kit() -> Kit:
    """The kit of the test that is running (its ``guardrails_kit`` fixture)."""
    if _current is None:
        raise KitError(
            "no test kit in this test: request the guardrails_kit fixture, or mark the test @pytest.mark.guardrails"
        )
    return _current
