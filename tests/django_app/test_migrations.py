"""The app's migrations apply on the configured database (PostgreSQL or SQLite) and are complete."""

from __future__ import annotations

import os

import pytest


@pytest.mark.django_db
@pytest.mark.smoke
def test_migrations_apply_and_are_complete_on_the_configured_database() -> None:
    from django.core.management import call_command
    from django.db import connection

    expected = {"postgres": "postgresql", "sqlite": "sqlite"}[os.environ.get("GUARDRAILS_TEST_DB", "sqlite")]
    assert connection.vendor == expected
    call_command("makemigrations", "guardrails", "--check", "--dry-run", verbosity=0)


NEW_INDEXES = {
    "guardrails_dl_reason_status": ["reason", "status", "last_failed_at"],
    "guardrails_dl_owner_status": ["owner", "status", "last_failed_at"],
    "guardrails_dl_task_status": ["task_name", "status", "last_failed_at"],
    "guardrails_dl_tenant_status": ["tenant", "status", "last_failed_at"],
    "guardrails_dl_correlation": ["correlation_id"],
    "guardrails_dl_idempotency_key": ["idempotency_key"],
}
#: Columns that had an index of their own (on PostgreSQL a LIKE-pattern one too) before.
REPLACED = [["reason"], ["owner"], ["task_name"], ["tenant"], ["status"], ["correlation_id"], ["idempotency_key"]]


def dead_letter_indexes() -> dict[str, list[str]]:
    from django.db import connection

    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, "guardrails_deadletter")
    return {name: info["columns"] for name, info in found.items() if info["index"] and not info["unique"]}


@pytest.mark.django_db(transaction=True)
def test_the_dead_letter_indexes_for_scale_apply_and_reverse() -> None:
    from django.core.management import call_command

    from django_celery_guardrails.models import DeadLetter

    # Given the app at its latest migration: an index per filter, leading with it; the ids' only indexes are the
    # new plain ones
    indexes = dead_letter_indexes()
    assert {name: indexes.get(name) for name in NEW_INDEXES} == NEW_INDEXES
    alone = sorted(name for name, columns in indexes.items() if columns in REPLACED)
    assert alone == ["guardrails_dl_correlation", "guardrails_dl_idempotency_key"]
    try:
        # When it goes back to before them
        call_command("migrate", "guardrails", "0010", verbosity=0)
        # Then they are gone, and the single-column indexes are back
        indexes = dead_letter_indexes()
        assert not set(NEW_INDEXES) & set(indexes)
        assert all(columns in indexes.values() for columns in REPLACED)
    finally:
        # And forwards again, they are back as they were (and the table works)
        call_command("migrate", "guardrails", verbosity=0)
    assert {name: dead_letter_indexes().get(name) for name in NEW_INDEXES} == NEW_INDEXES
    assert DeadLetter.objects.filter(owner="payments", status="open").count() == 0


@pytest.mark.django_db(transaction=True)
def test_the_fingerprint_and_argument_indexes_apply_reverse_and_let_older_workers_record() -> None:
    from django.core.management import call_command
    from django.db import connection

    from django_celery_guardrails.models import DeadLetter

    postgres = connection.vendor == "postgresql"
    gin = {"guardrails_dl_args_gin": ["args"], "guardrails_dl_kwargs_gin": ["kwargs"]} if postgres else {}
    added = {"guardrails_dl_fingerprint": ["fingerprint", "status", "last_failed_at"], **gin}
    # Given the app at its latest migration: the cause's index, and on PostgreSQL the arguments' GIN indexes
    assert {name: dead_letter_indexes().get(name) for name in added} == added
    try:
        # When it goes back to before fingerprints
        call_command("migrate", "guardrails", "0024", verbosity=0)
        # Then they are gone
        assert not set(added) & set(dead_letter_indexes())
    finally:
        call_command("migrate", "guardrails", verbosity=0)
    assert {name: dead_letter_indexes().get(name) for name in added} == added
    if not postgres:
        return
    # And a worker of the release before, whose INSERT names no fingerprint, still records its dead letter
    columns = [f.column for f in DeadLetter._meta.concrete_fields if f.column not in ("id", "fingerprint")]
    values = {
        "task_name": "t.older",
        "task_id": "older-release",
        "args": "[]",
        "kwargs": "{}",
        "header": "{}",
        "history": "[]",
        "arguments_are_repr": False,
        "attempts": 1,
        "status": "open",
        "handled_at": None,
    }
    row = [values.get(column, "") for column in columns]
    times = {"first_failed_at", "last_failed_at", "created_at"}
    marks = ", ".join("now()" if column in times else "%s" for column in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO guardrails_deadletter ({', '.join(columns)}) VALUES ({marks})",
            [value for column, value in zip(columns, row, strict=True) if column not in times],
        )
    assert DeadLetter.objects.get(task_id="older-release").fingerprint == ""
