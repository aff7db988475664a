from django.db import migrations

#: GIN indexes of the stored arguments for the admin's argument search (``order_id=42``:
#: django_celery_guardrails.argument_search), PostgreSQL only: JSON containment (``@>``) through ``jsonb_path_ops``
#: (smaller and faster than the default operator class for containment, which is all the search asks). Built
#: CONCURRENTLY: workers go on writing dead letters meanwhile. Other databases search a bounded scan instead.
INDEXES = {"guardrails_dl_args_gin": "args", "guardrails_dl_kwargs_gin": "kwargs"}


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("guardrails", "DeadLetter")._meta.db_table)
    for name, column in INDEXES.items():
        schema_editor.execute(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {schema_editor.quote_name(name)} "
            f"ON {table} USING gin ({schema_editor.quote_name(column)} jsonb_path_ops)"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}")


class Migration(migrations.Migration):
    # CONCURRENTLY cannot run inside a transaction.
    atomic = False

    dependencies = [
        ('guardrails', '0025_dead_letter_fingerprint'),
    ]

    operations = [migrations.RunPython(create, drop, elidable=False)]
