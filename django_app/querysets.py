"""QuerySets of the guardrails models."""

from __future__ import annotations

from typing import Any

from django.db import models


class DependencyStateQuerySet(models.QuerySet[Any]):
    def locked(self, dependency: str) -> Any:
        """The row of ``dependency``, created if missing, locked until the end of the transaction."""
        row, _ = self.select_for_update().get_or_create(dependency=dependency)
        return row
