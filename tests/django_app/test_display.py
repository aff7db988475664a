"""Stored values shown as they are: control and invisible characters written out on every page and in every
command's output, never obeyed (a bidi override reversing ``RTL\\u202egnp.exe`` into ``RTLexe.png``).

One function does it (``django_celery_guardrails.display.escape``); these tests plant such characters in every
field of a dead letter and a ledger record, open each admin page that shows them (through the real views) and
run the commands, and find none of them raw and each of them written out.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from django_celery_guardrails import health
from django_celery_guardrails.display import escape
from django_celery_guardrails.models import DeadLetter, ScheduledRun
from tests.support.services import BROKER_URLS

pytestmark = pytest.mark.django_db
#: The characters planted: a bidi override and isolate, a zero-width space, a byte-order mark, an ESC (a
#: terminal's colours), a C1 control, a line separator, a bell, a carriage return.
PLANTED = "\u202e\u2066\u200b\ufeff\x1b\x85\u2028\x07\r"
FILE = "RTL\u202egnp.exe"  # reads RTLexe.png when obeyed


def test_each_control_and_invisible_character_is_written_out_and_the_rest_kept() -> None:
    # Given the characters the issue names, and others of the same kinds
    hidden = [
        *map(chr, range(0x00, 0x20)),  # C0
        "\x7f",
        *map(chr, range(0x80, 0xA0)),  # DEL, C1
        *map(chr, range(0x200B, 0x2010)),  # zero-width, LRM, RLM
        *map(chr, range(0x202A, 0x202F)),  # bidi embeddings and overrides
        *map(chr, range(0x2066, 0x206A)),  # bidi isolates
        "\ufeff",
        "\u061c",
        "\u2028",
        "\u2029",
        "\u00ad",
        "\U000e0041",  # a tag character (invisible)
        "\ud800",  # a lone surrogate: no page could encode it
    ]
    # Then each is an escape of plain ASCII that JSON reads back as that character
    for character in hidden:
        written = escape(character)
        assert written.isascii() and written.startswith("\\") and len(written) > 1, repr(character)
    assert [escape(c) for c in "\x00\x1b\x85\u202e\n\r\t\U000e0041"] == [
        "\\u0000",
        "\\u001b",
        "\\u0085",
        "\\u202e",
        "\\n",
        "\\r",
        "\\t",
        "\\udb40\\udc41",
    ]
    # And text of any script, emoji and their joiners' neighbours, spaces, is kept as it is
    for kept in ("payments", "Zürich", "東京", "مرحبا", "שלום", "👍", "a b\u00a0c", "tab\tless"[:3]):
        assert escape(kept) == kept
    # And a value on several lines keeps its newlines and tabs, never a carriage return
    assert escape("a\n\tb\r\n", multiline=True) == "a\n\tb\\r\n"
    # And in HTML each escape is marked, the rest escaped as HTML
    assert escape(f"<b>{FILE}</b>", html=True) == (
        '&lt;b&gt;RTL<span class="gr-escaped" title="U+202E">\\u202e</span>gnp.exe&lt;/b&gt;'
    )


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch, queue_name: str) -> Celery:
    """The app the admin pages read (queues, store, policies): the test Redis broker, the Django store."""
    app = Celery("display", broker=BROKER_URLS["redis"], set_as_current=False)
    app.conf.task_default_queue = queue_name
    app.conf.guardrails = {"store": "django", "dead_letter_sinks": ["django"], "activity": False}
    monkeypatch.setattr(health, "celery_app", lambda: app)
    return app


@pytest.fixture
def hostile() -> DeadLetter:
    """A dead letter and a ledger record with the planted characters in every field the pages show."""
    now = datetime.now(UTC)
    ScheduledRun.objects.create(
        schedule=f"nightly {PLANTED}", period=now - timedelta(hours=1), status="failed", reason=f"why {PLANTED}"
    )
    return DeadLetter.objects.create(
        task_name=f"shop.tasks.{PLANTED}charge",
        task_id=f"id-{PLANTED}-{uuid.uuid4().hex}",
        reason=f"permanent{PLANTED}",
        owner=f"payments {PLANTED}",
        tenant=f"acme{PLANTED}",
        args=[FILE, PLANTED],
        kwargs={FILE: PLANTED, "nested": {f"key{PLANTED}": [PLANTED]}},
        header={"tenant": f"acme{PLANTED}"},
        exc_type=f"shop.{PLANTED}Error",
        exc_message=f"refused {FILE} {PLANTED}",
        traceback=f"Traceback (most recent call last):\n  File {FILE}\n{PLANTED}Error",
        history=[{"n": 1, "host": f"worker{PLANTED}", "class": "permanent", "exc": f"Error: {PLANTED}", "note": FILE}],
        first_failed_at=now - timedelta(minutes=5),
        last_failed_at=now - timedelta(minutes=5),
    )


def shows_escaped(where: str, text: str) -> None:
    """None of the planted characters raw in ``text``; the bidi override written out."""
    raw = sorted({f"U+{ord(c):04X}" for c in text if c in PLANTED and c != "\r"} | ({"CR"} if "\r" in text else set()))
    assert raw == [], f"{where}: {raw} shown raw"
    assert "\\u202e" in text, f"{where}: the bidi override is not written out"


def test_every_admin_page_writes_the_planted_characters_out(
    admin_client: Client, app: Celery, hostile: DeadLetter
) -> None:
    pk = hostile.pk
    run = ScheduledRun.objects.get()
    # When an admin resolves the record (a LogEntry names it) and opens every page that shows it
    admin_client.post(
        reverse("admin:guardrails_deadletter_changelist"),
        {"action": "resolve_selected", "_selected_action": [pk], "index": "0", "post": "yes"},
    )
    DeadLetter.objects.filter(pk=pk).update(status="open")
    pages = {
        "dead letters": reverse("admin:guardrails_deadletter_changelist"),
        "dead letter": reverse("admin:guardrails_deadletter_change", args=[pk]),
        "its history": reverse("admin:guardrails_deadletter_history", args=[pk]),
        "recent actions": reverse("admin:index"),
        "edit and replay": reverse("admin:guardrails_deadletter_edit_and_replay", args=[pk]),
        "replay": reverse("admin:guardrails_deadletter_replay", args=[pk]),
        "overview": reverse("admin:guardrails_deadletter_overview"),
        "dashboard": reverse("admin:guardrails_dashboard_changelist"),
        "run ledger": reverse("admin:guardrails_scheduledrun_changelist"),
        "run": reverse("admin:guardrails_scheduledrun_change", args=[run.pk]),
        "schedule health": reverse("admin:guardrails_scheduledrun_health"),
        "delete": reverse("admin:guardrails_deadletter_delete", args=[pk]),
    }
    for name, url in pages.items():
        page = admin_client.get(url)
        assert page.status_code == 200, (name, page.status_code)
        # Then none is shown raw, and each is written out (marked, on hover the code point)
        shows_escaped(name, page.content.decode())
    # And so does Django's own confirmation of deleting it from the list (it names the record by str())
    confirm = admin_client.post(
        reverse("admin:guardrails_deadletter_changelist"), {"action": "delete_selected", "_selected_action": [pk]}
    )
    assert confirm.status_code == 200
    shows_escaped("delete selected", confirm.content.decode())
    # And the record's page shows the file name as stored, its escape marked
    html = admin_client.get(pages["dead letter"]).content.decode()
    assert 'RTL<span class="gr-escaped" title="U+202E">\\u202e</span>gnp.exe' in html
    # And the edit form's JSON, written out, is still the record's arguments
    form = admin_client.get(pages["edit and replay"]).context["form"]
    shown = form["kwargs"].value()  # the textarea's JSON
    assert shown.isascii() and form.fields["kwargs"].to_python(shown) == hostile.kwargs


def test_the_commands_write_the_planted_characters_out(app: Celery, hostile: DeadLetter) -> None:
    # When the record is listed and shown as text, and a dry run of its replay is asked
    outputs = {}
    for name, arguments in {
        "list": ["guardrails_deadletters", "list"],
        "show": ["guardrails_deadletters", "show", str(hostile.pk)],
    }.items():
        out = StringIO()
        call_command(*arguments, stdout=out)
        outputs[name] = out.getvalue()
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="would be refused"):  # its task is not registered
        call_command("guardrails_replay", "--dry-run", stdout=out, stderr=err)
    outputs["replay --dry-run"] = out.getvalue() + err.getvalue()
    # Then none is printed raw, and a stored value never makes a line of its own
    for name, text in outputs.items():
        shows_escaped(name, text)
    assert len(outputs["list"].splitlines()) == 2  # the record, the count
    shown = dict(re.findall(r"^(\w+): (.*)$", outputs["show"], re.M))
    assert shown["owner"] == escape(hostile.owner) and shown["args"].startswith('["RTL\\u202egnp.exe"')
    assert outputs["show"].count("\n") == len(shown) + hostile.traceback.count("\n")  # the traceback's own lines


def test_the_dashboard_legend_and_titles_are_written_out(admin_client: Client, app: Celery, hostile: Any) -> None:
    # When the dashboard charts a reason holding the planted characters
    html = admin_client.get(reverse("admin:guardrails_dashboard_changelist")).content.decode()
    legend = re.search(r'<ul class="gr-legend">(.*?)</ul>', html, re.S)
    # Then the legend writes them out, marked
    assert legend is not None and 'permanent<span class="gr-escaped" title="U+202E">\\u202e</span>' in legend.group(1)
    # And the owner's row too
    assert 'payments <span class="gr-escaped" title="U+202E">\\u202e</span>' in html
