"""The dead-letter change list over a big table: a count that stops at its cap (never a whole-table COUNT),
filter choices without a DISTINCT over the table, and a search through the ids' indexes. Through the real
admin view, on PostgreSQL and SQLite; the cap is lowered so that a few hundred rows stand for millions."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_celery_guardrails.models import DeadLetter
from django_celery_guardrails.paging import CappedCountPaginator, distinct_values

pytestmark = pytest.mark.django_db
CAP = 50
CHANGELIST = "admin:guardrails_deadletter_changelist"


@pytest.fixture
def cap(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(CappedCountPaginator, "cap", CAP)
    return CAP


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser(f"paging-{uuid.uuid4().hex[:6]}", "p@example.com", "pw"))
    return client


def letters(count: int, **fields: Any) -> list[DeadLetter]:
    moment = datetime(2026, 11, 30, 8, tzinfo=UTC)
    return DeadLetter.objects.bulk_create(
        DeadLetter(
            **{
                "task_name": "shop.tasks.charge",
                "task_id": f"task-{uuid.uuid4()}",
                "correlation_id": f"cid-{uuid.uuid4()}",
                "reason": "permanent",
                "owner": "payments",
                "tenant": "acme",
                "first_failed_at": moment,
                "last_failed_at": moment + timedelta(seconds=n),
                **fields,
            }
        )
        for n in range(count)
    )


def counts(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]


def test_a_filter_matching_more_than_the_cap_counts_no_further_and_says_so(cap: int, admin_client: Client) -> None:
    # Given more open records of one owner than the cap, and a few of another
    letters(cap + 30)
    letters(3, owner="ops")
    # When the change list is filtered by owner
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse(CHANGELIST), {"owner": "payments", "status": "open"})
    # Then the one COUNT reads at most cap + 1 rows (a LIMIT inside it), and the page says "50+"
    assert page.status_code == 200
    (count,) = counts(queries)
    assert re.search(rf"LIMIT {cap + 1}\b", count), count
    assert f"{cap}+ dead letters".encode() in page.content
    assert page.context["cl"].result_count == cap
    # And a filter matching fewer than the cap is counted exactly
    few = admin_client.get(reverse(CHANGELIST), {"owner": "ops"})
    assert b"3 dead letters" in few.content and len(few.context["cl"].result_list) == 3


def test_the_whole_table_is_never_counted(cap: int, admin_client: Client) -> None:
    # Given more records than the cap, analyzed (as autovacuum would)
    letters(cap + 30)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE guardrails_deadletter")
    # When the change list is opened unfiltered
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse(CHANGELIST))
    assert page.status_code == 200
    if connection.vendor == "postgresql":
        # Then PostgreSQL's estimate stands for the count: no COUNT at all
        assert counts(queries) == []
        assert re.search(rb"~\d+ dead letters", page.content)
    else:
        # Then (SQLite keeps no estimate) the count stops at the cap
        (count,) = counts(queries)
        assert re.search(rf"LIMIT {cap + 1}\b", count), count
        assert f"{cap}+ dead letters".encode() in page.content


def test_filter_choices_are_read_without_a_distinct_over_the_table(admin_client: Client) -> None:
    # Given records of three owners and two reasons
    letters(4)
    letters(2, owner="ops", reason="poison")
    letters(1, owner="", tenant="globex")
    # When the change list is opened
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse(CHANGELIST))
    # Then no query is a SELECT DISTINCT, and the side bar offers each value once, in order
    assert not [q["sql"] for q in queries.captured_queries if "DISTINCT" in q["sql"].upper()]
    filters = {
        spec.title: [c["display"] for c in spec.choices(page.context["cl"])] for spec in page.context["cl"].filter_specs
    }
    assert filters["owner"] == ["All", "", "ops", "payments"]
    assert filters["reason"] == ["All", "permanent", "poison"]
    assert filters["tenant"] == ["All", "acme", "globex"]
    # And the values are the first ones only when there are more than the limit
    assert distinct_values(DeadLetter, "owner", limit=2) == ["", "ops"]


def test_a_search_finds_a_record_by_its_exact_task_or_correlation_id(admin_client: Client) -> None:
    # Given many records
    records = letters(20)
    wanted = records[7]
    # When searching by the task id, then by the correlation id
    with CaptureQueriesContext(connection) as queries:
        by_task = admin_client.get(reverse(CHANGELIST), {"q": wanted.task_id})
    # (read now: the next request empties the query log they are read from)
    searched = [q["sql"] for q in queries.captured_queries if wanted.task_id in q["sql"]]
    by_cid = admin_client.get(reverse(CHANGELIST), {"q": wanted.correlation_id})
    # Then each finds that record only, by equality (an index lookup), never UPPER(...) or LIKE
    assert [r.pk for r in by_task.context["cl"].result_list] == [wanted.pk]
    assert [r.pk for r in by_cid.context["cl"].result_list] == [wanted.pk]
    assert searched and not [sql for sql in searched if "UPPER(" in sql.upper() or " LIKE " in sql.upper()]
    # And part of an id finds nothing
    partial = admin_client.get(reverse(CHANGELIST), {"q": wanted.task_id[:12]})
    assert list(partial.context["cl"].result_list) == []
