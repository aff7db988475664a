"""Deprecations raised by Celery, kombu and Django fail the test that meets them (pyproject.toml's
filterwarnings), so the next release's breakage shows up in the suite first."""

from __future__ import annotations

import warnings

import pytest
from celery.exceptions import CDeprecationWarning
from django.utils.deprecation import RemovedInNextVersionWarning


@pytest.mark.parametrize("module", ["celery.app.task", "kombu.transport.redis", "django.db.models"])
def test_a_deprecation_raised_in_celery_kombu_or_django_is_an_error(module: str) -> None:
    with pytest.raises(DeprecationWarning, match="going away"):
        warnings.warn_explicit("going away", DeprecationWarning, f"{module}.py", 1, module=module)


@pytest.mark.parametrize("category", [CDeprecationWarning, RemovedInNextVersionWarning])
def test_celerys_and_djangos_own_deprecations_are_errors_wherever_they_are_attributed(category: type) -> None:
    with pytest.raises(category):
        warnings.warn_explicit(
            "going away", category, "celery_guardrails/runtime/task.py", 1, module="celery_guardrails.runtime.task"
        )


def test_a_deprecation_in_another_package_is_a_warning() -> None:
    # "celery_guardrails" starts with "celery": the filters match whole package names only
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("elsewhere", DeprecationWarning, "x.py", 1, module="celery_guardrails.runtime.task")
