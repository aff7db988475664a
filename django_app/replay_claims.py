"""A replay's hold on its records: the claim that moves a batch of open records to ``replayed`` (each with the
task id it will be published as) before anything is published, and the putting back of those whose message did
not go out. Two concurrent replays of a record publish once: each sets its own new task id, and reading the ids
back tells which one won."""

from __future__ import annotations

import logging
import sqlite3
import time

from django.db import DatabaseError, close_old_connections, connection
from django.db.models import CharField
from django.db.models.expressions import RawSQL
from django.utils import timezone

from .models import DeadLetter

logger = logging.getLogger(__name__)

#: Tries at putting a record back to open when its replay could not be published (a second apart).
PUT_BACK_TRIES = 3


def claim(task_ids: dict[int, str], handled_by: str) -> set[int]:
    """The records of ``task_ids`` (record id -> new task id) this call moved from open to replayed."""
    if not task_ids:
        return set()
    if claims_in_one_statement():
        return _claim_returning(task_ids, handled_by)
    # CASE id WHEN <pk> THEN <task id> ... END written out (Django's Case(When()) cost more than the UPDATE)
    pk = connection.ops.quote_name(str(DeadLetter._meta.pk.column))
    new_id = RawSQL(
        f"CASE {pk} {' '.join(['WHEN %s THEN %s'] * len(task_ids))} END",
        [value for pair in task_ids.items() for value in pair],
        output_field=CharField(),
    )
    DeadLetter.objects.filter(pk__in=task_ids, status=DeadLetter.Status.OPEN).update(
        status=DeadLetter.Status.REPLAYED, replayed_task_id=new_id, handled_by=handled_by, handled_at=timezone.now()
    )
    now_held = dict(DeadLetter.objects.filter(pk__in=task_ids).values_list("pk", "replayed_task_id"))
    return {pk for pk, task_id in task_ids.items() if now_held.get(pk) == task_id}


def claims_in_one_statement() -> bool:
    """PostgreSQL, and SQLite from 3.35 (UPDATE ... FROM and RETURNING): the claim is one statement."""
    vendor = connection.vendor
    return vendor == "postgresql" or (vendor == "sqlite" and sqlite3.sqlite_version_info >= (3, 35))


def _claim_returning(task_ids: dict[int, str], handled_by: str) -> set[int]:
    """The claim as one ``UPDATE ... FROM (VALUES ...) RETURNING``: each record joined to its new task id (where a
    CASE of 500 branches was evaluated for every row), the ones this call moved read back in the same statement."""
    table, pk, status, replayed_as, by, at = (
        connection.ops.quote_name(name)
        for name in (DeadLetter._meta.db_table, "id", "status", "replayed_task_id", "handled_by", "handled_at")
    )
    rows = ", ".join(["(CAST(%s AS bigint), %s)"] * len(task_ids))
    sql = (
        f"WITH claimed (record_id, task_id) AS (VALUES {rows}) "
        f"UPDATE {table} SET {status} = %s, {replayed_as} = claimed.task_id, {by} = %s, {at} = %s FROM claimed "
        f"WHERE {table}.{pk} = claimed.record_id AND {table}.{status} = %s RETURNING {table}.{pk}"
    )
    handled_at = connection.ops.adapt_datetimefield_value(timezone.now())
    params = [*(value for pair in task_ids.items() for value in pair), "replayed", handled_by, handled_at, "open"]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {int(row[0]) for row in cursor.fetchall()}


def put_back(task_ids: dict[int, str]) -> None:
    """Open records whose replay was not published again (each still holding the task id it claimed). The
    database may be what failed: a few tries, then an error that names the records and the task ids they
    claim, for someone to reopen them by hand."""
    if not task_ids:
        return
    for attempt in range(1, PUT_BACK_TRIES + 1):
        try:
            DeadLetter.objects.filter(pk__in=task_ids, replayed_task_id__in=task_ids.values()).update(
                status=DeadLetter.Status.OPEN, replayed_task_id="", handled_by="", handled_at=None
            )
            return
        except DatabaseError:
            close_old_connections()
            if attempt < PUT_BACK_TRIES:
                time.sleep(1.0)
    logger.error(
        "Dead letter(s) %s say they were replayed as %s, but nothing was published: reopen them (the database "
        "could not be reached to put them back)",
        ", ".join(map(str, task_ids)),
        ", ".join(task_ids.values()),
    )
