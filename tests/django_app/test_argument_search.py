"""Dead letters found by argument (``order_id=42``) in the admin's search box, on records a real worker made:
positional arguments by their parameter's name, keyword arguments and nested values by their path, never a
redacted value; through GIN indexes on PostgreSQL, a bounded scan elsewhere."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_celery_guardrails import argument_search
from django_celery_guardrails.models import DeadLetter
from tests.proj import django_tasks
from tests.support.admin_users import logged_in
from tests.support.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
CARD = "4111 1111 1111 1111"


@pytest.fixture
def celery_app(celery_app: Any) -> Any:
    celery_app.conf.guardrails = {**celery_app.conf.guardrails, "dead_letter_sinks": ["django"]}
    return celery_app


@pytest.fixture
def records(celery_worker: Any) -> dict[str, DeadLetter]:
    """Three declined orders (the order id positional) and a refused card (keyword arguments: a card number the
    record keeps redacted, and an order as a nested mapping)."""
    order = uuid.uuid4().int % 10**8
    published = {f"declined {n}": django_tasks.decline.delay(order + n) for n in range(3)}
    published["card"] = django_tasks.fail_with.delay(
        "permanent", card_number=CARD, order={"id": order, "ref": f"A-{order}"}, contains=order
    )
    ids = {name: result.id for name, result in published.items()}
    wait_for("the dead letters", lambda: DeadLetter.objects.filter(task_id__in=ids.values()).count() == len(ids))
    found = {name: DeadLetter.objects.get(task_id=task_id) for name, task_id in ids.items()}
    found["order"] = order  # type: ignore[assignment]
    return found


def searched(client: Client, term: str) -> tuple[set[int], Any]:
    page = client.get(reverse("admin:guardrails_deadletter_changelist"), {"q": term})
    assert page.status_code == 200
    return {r.pk for r in page.context["cl"].result_list}, page


@pytest.fixture
def client() -> Client:
    return logged_in()


def test_a_positional_argument_is_found_by_its_parameter_name_and_shown_matched(
    records: dict[str, Any], client: Client
) -> None:
    order = records["order"]
    # When the search box asks for one order (the decline task takes it positionally)
    found, page = searched(client, f"order_id={order + 1}")
    # Then that order's record only, the matched argument marked in its row
    assert found == {records["declined 1"].pk}
    assert f'<mark class="dl-matched">order_id={order + 1}</mark>'.encode() in page.content
    # And by its position too, and as text only when quoted
    assert searched(client, f"#0={order + 2}")[0] == {records["declined 2"].pk}
    assert searched(client, f'order_id="{order + 1}"')[0] == set()


def test_keyword_and_nested_arguments_are_found_by_their_path(records: dict[str, Any], client: Client) -> None:
    order, card = records["order"], records["card"]
    assert searched(client, f"order.id={order}")[0] == {card.pk}
    assert searched(client, f"order.ref=A-{order}")[0] == {card.pk}
    assert searched(client, "#0=permanent")[0] >= {card.pk}
    assert searched(client, f"order.id={order + 1}")[0] == set()
    # And an argument named as one of Django's lookups is an argument all the same
    assert searched(client, f"contains={order}")[0] == {card.pk}
    # And an id is still searched as one
    assert searched(client, records["declined 0"].task_id)[0] == {records["declined 0"].pk}


def test_a_redacted_value_never_matches(records: dict[str, Any], client: Client) -> None:
    card = records["card"]
    assert card.kwargs["card_number"] == "[redacted]"
    # When the secret itself is searched for: the record does not keep it
    assert searched(client, f"card_number={CARD}")[0] == set()
    # When the placeholder is: it stands for nothing, and the page says so
    found, page = searched(client, "card_number=[redacted]")
    assert found == set()
    assert b"[redacted] stands for a value the record does not keep" in page.content


def test_postgresql_answers_from_the_gin_indexes(records: dict[str, Any]) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the GIN indexes are PostgreSQL's")
    order = records["order"]
    for term in (f"order_id={order}", f"order.id={order}"):
        parsed = argument_search.parse(term)
        assert parsed is not None
        query = argument_search.search(parsed).of(DeadLetter.objects.order_by())  # the condition, not the paging
        sql, params = query.query.sql_with_params()
        with connection.cursor() as cursor:
            # A handful of rows: the planner would scan the table; asked not to, it shows what serves the query
            cursor.execute("SET enable_seqscan = off")
            try:
                cursor.execute(f"EXPLAIN {sql}", params)
                plan = "\n".join(row[0] for row in cursor.fetchall())
            finally:
                cursor.execute("RESET enable_seqscan")
        assert "guardrails_dl_args_gin" in plan or "guardrails_dl_kwargs_gin" in plan, plan


def test_without_an_index_the_scan_is_bounded_to_the_newest_records(
    records: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL searches every record through its indexes")
    monkeypatch.setattr(argument_search, "SCAN_LIMIT", 2)
    order = records["order"]
    # Given more records than the bound: the oldest declined order is out of reach, the newest in it
    newest = DeadLetter.objects.order_by("-pk")[:2]
    term = argument_search.parse(f"order_id={order}")
    assert term is not None
    found = argument_search.search(term)
    assert found.bounded
    assert set(found.of(DeadLetter.objects.all()).values_list("pk", flat=True)) <= {r.pk for r in newest}
