"""The app's migrations apply on the configured database (PostgreSQL or SQLite) and are complete."""

from __future__ import annotations

import os

import pytest


@pytest.mark.django_db
def test_migrations_apply_and_are_complete_on_the_configured_database() -> None:
    from django.core.management import call_command
    from django.db import connection

    expected = {"postgres": "postgresql", "sqlite": "sqlite"}[os.environ.get("GUARDRAILS_TEST_DB", "sqlite")]
    assert connection.vendor == expected
    call_command("makemigrations", "guardrails", "--check", "--dry-run", verbosity=0)
