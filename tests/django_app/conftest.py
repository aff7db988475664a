"""Django tests run on PostgreSQL or SQLite (GUARDRAILS_TEST_DB); the database service is required."""

from __future__ import annotations

import pytest
from django.conf import settings

from tests.support.services import require


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    # (pytest-django's own fixture, kept: under pytest-xdist each process gets a test database of its own)
    if settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        require("postgres")
