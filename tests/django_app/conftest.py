"""Django tests run on PostgreSQL or SQLite (GUARDRAILS_TEST_DB); the database service is required."""

from __future__ import annotations

import pytest
from django.conf import settings

from tests.support.services import require


@pytest.fixture(scope="session")
def django_db_modify_db_settings() -> None:
    if settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        require("postgres")
