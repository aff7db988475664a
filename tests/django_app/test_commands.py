"""The management commands as an operator types them: bad input, Ctrl-C, and ``guardrails_deadletters``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_celery_guardrails.models import DeadLetter, SealedMessage
from tests.support import zygote
from tests.support.waiting import BOUND, wait_for
from tests.support.workers import ROOT, proj_env

pytestmark = pytest.mark.django_db(transaction=True)


def manage(*arguments: str) -> subprocess.Popen[str]:
    """``python -m django <arguments>`` with the test settings, on the test database."""
    env = {**os.environ, **proj_env(queue="gr-test-commands", django=True), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "django", *arguments],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A shell that starts the suite in the background (`make test &`, nohup) leaves SIGINT ignored, and an
        # ignored signal stays ignored in children: Python then never turns Ctrl-C into KeyboardInterrupt.
        # The command is run as a terminal would run it.
        restore_signals=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["guardrails_replay", "--since", "yesterday"], "--since 'yesterday': give an ISO date/time"),
        (["guardrails_replay", "--reason", "permanant"], "--reason 'permanant' is not known: did you mean 'permanent'"),
        (["guardrails_replay", "--tenant", "a/b"], "--tenant: tenant id 'a/b' may hold only"),
        (["guardrails_prune", "--older-than", "2x"], "--older-than '2x': give an age such as 90s, 30m, 2h, 7d"),
        (["guardrails_watchdog", "--loop", "soon"], "--loop 'soon': give an age"),
        (["guardrails_watchdog", "--loop", "0"], "--loop '0': give a positive age"),
        (["guardrails_deadletters", "show", "abc"], "'abc' is not a dead letter id"),
        (["guardrails_deadletters", "show", "999999999"], "no dead letter 999999999"),
        (["guardrails_deadletters", "list", "--status", "gone"], "--status 'gone' is not known"),
        (["guardrails_deadletters", "list", "--limit", "-3"], "--limit '-3': give a whole number from 1 to 1,000,000"),
        (["guardrails_deadletters", "discard", "999999999"], "no dead letter 999999999; nothing was changed"),
        # The review's: an OverflowError, an OverflowError, a DataError on PostgreSQL (test_bad_input.py has more)
        (["guardrails_deadletters", "list", "--since", "99999999999999999999d"], "give an age of at most 100 years"),
        (["guardrails_prune", "--older-than", "1000000000d"], "--older-than '1000000000d': give an age of at most"),
        (["guardrails_deadletters", "resolve", "4", "--by", "x" * 500], "--by: give at most 150 characters (got 500)"),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(arguments: list[str], says: str) -> None:
    # When the command is given a bad value
    env = {**os.environ, **proj_env(queue="gr-test-commands", django=True), "PYTHONPATH": str(ROOT)}
    done = zygote.run([sys.executable, "-m", "django", *arguments], cwd=ROOT, env=env, timeout=BOUND)
    out, err = done.stdout, done.stderr
    # Then it exits 1 with one line that names the option, and no traceback
    assert done.returncode == 1, (out, err)
    assert err.count("\n") == 1 and err.startswith("CommandError: ") and says in err, err
    assert "Traceback" not in out + err


def test_ctrl_c_stops_the_watchdog_loop_without_a_traceback() -> None:
    # Given the watchdog checking every second
    process = manage("guardrails_watchdog", "--loop", "1s")
    lines: list[str] = []
    assert process.stdout is not None
    wait_for("a first check", lambda: "Recorded" in (lines.append(process.stdout.readline()) or "".join(lines)))
    # When Ctrl-C is pressed
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=BOUND)
    # Then it says it stopped and exits 0
    assert process.returncode == 0, err
    assert out.rstrip().endswith("Stopped.") and "Traceback" not in err, (out, err)


def letter(number: int, **fields: object) -> DeadLetter:
    moment = datetime(2026, 11, 30, 8, number, tzinfo=UTC)
    values = {
        "task_name": "shop.tasks.charge",
        "task_id": f"task-{number}",
        "reason": "permanent",
        "owner": "payments",
        "tenant": "acme",
        "kwargs": {"api_token": "[redacted]"},
        "first_failed_at": moment,
        "last_failed_at": moment,
        **fields,
    }
    return DeadLetter.objects.create(**values)


def test_list_filters_and_prints_json_lines_newest_first() -> None:
    # Given four records of two reasons and two owners, one already resolved
    records = [
        letter(1),
        letter(2, reason="poison", owner="ops"),
        letter(3),
        letter(4, status="resolved"),
    ]
    out = StringIO()
    # When the open permanent ones are listed as JSON
    call_command("guardrails_deadletters", "list", "--reason", "permanent", "--json", stdout=out)
    # Then one JSON object per line, newest first, open only
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [row["id"] for row in rows] == [records[2].pk, records[0].pk]
    assert rows[0] == {
        "id": records[2].pk,
        "task_name": "shop.tasks.charge",
        "reason": "permanent",
        "status": "open",
        "owner": "payments",
        "tenant": "acme",
        "attempts": 1,
        "last_failed_at": "2026-11-30T08:03:00Z",
        "task_id": "task-3",
    }
    # And filters by owner, every status, and a limit
    out = StringIO()
    call_command("guardrails_deadletters", "list", "--status", "all", "--limit", "2", stdout=out)
    assert out.getvalue().splitlines()[-1] == "2 record(s)." and "task-4" in out.getvalue()
    out = StringIO()
    call_command("guardrails_deadletters", "list", "--owner", "ops", "--json", stdout=out)
    assert [json.loads(line)["task_id"] for line in out.getvalue().splitlines()] == ["task-2"]


def test_show_prints_the_record_redacted_and_never_the_sealed_copy() -> None:
    record = letter(1)
    SealedMessage.objects.create(dead_letter=record, token="gAAAA-sealed")
    out = StringIO()
    call_command("guardrails_deadletters", "show", str(record.pk), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert (shown["task_id"], shown["kwargs"], shown["sealed"]) == ("task-1", {"api_token": "[redacted]"}, True)
    assert "gAAAA-sealed" not in out.getvalue()


def test_discard_and_resolve_close_the_records_named_only() -> None:
    # Given three open records
    one, two, three = letter(1), letter(2), letter(3)
    # When one is discarded and one resolved
    out = StringIO()
    call_command("guardrails_deadletters", "discard", str(two.pk), "--by", "alice", stdout=out)
    assert out.getvalue().strip() == "Discarded 1 of 1 dead letter(s) (the others were not open)."
    call_command("guardrails_deadletters", "resolve", str(three.pk), str(two.pk), stdout=out)
    # Then those change, the third stays open, and a closed record is not closed again
    statuses = dict(DeadLetter.objects.values_list("pk", "status"))
    assert statuses == {one.pk: "open", two.pk: "discarded", three.pk: "resolved"}
    assert DeadLetter.objects.get(pk=two.pk).handled_by == "alice"
    assert DeadLetter.objects.get(pk=three.pk).handled_by.startswith("shell")
    # And --json says which changed
    out = StringIO()
    call_command("guardrails_deadletters", "discard", str(one.pk), str(two.pk), "--json", "--by", "bob", stdout=out)
    assert json.loads(out.getvalue()) == {"status": "discarded", "changed": [one.pk], "by": "bob"}
    DeadLetter.objects.filter(pk=one.pk).update(status="open")
    # And an id that does not exist changes nothing
    with pytest.raises(CommandError, match="no dead letter 0"):
        call_command("guardrails_deadletters", "discard", str(one.pk), "0")
    assert DeadLetter.objects.get(pk=one.pk).status == "open"


def test_prune_and_since_read_ages() -> None:
    from django_celery_guardrails.management.arguments import age, since

    assert [age(v, option="-x") for v in ("90s", "30m", "2h", "7d", "2w", "45", "1.5h")] == [
        timedelta(seconds=90),
        timedelta(minutes=30),
        timedelta(hours=2),
        timedelta(days=7),
        timedelta(weeks=2),
        timedelta(seconds=45),
        timedelta(hours=1.5),
    ]
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    assert since("2h", option="--since", now=now) == datetime(2026, 11, 30, 10, tzinfo=UTC)
    assert since("2026-11-29T08:00+00:00", option="--since") == datetime(2026, 11, 29, 8, tzinfo=UTC)


def test_replay_refuses_not_idempotent_records_unless_the_operator_says_they_checked() -> None:
    # Given an open not_idempotent record of a task the project still runs: the receipt mail may have gone out
    record = letter(
        1, task_name="example_project.shop.tasks.send_receipt", reason="not_idempotent", args=[42], kwargs={}
    )
    refusal = "not_idempotent: it may already have acted (charged a card, sent a mail) before it failed"
    # When the operator replays the not_idempotent records without the flag
    process = manage("guardrails_replay", "--reason", "not_idempotent")
    out, err = process.communicate(timeout=BOUND)
    # Then it exits 1, names the record on stderr with why and how to replay it anyway, and leaves it open
    assert process.returncode == 1, (out, err)
    first, last = err.splitlines()
    assert first.startswith(f"refused {record.pk}: {refusal}") and "--allow-not-idempotent" in first, err
    assert last == "CommandError: 1 dead letter(s) refused (reasons above)"
    assert out.splitlines()[-1] == "Replayed 0 dead letter(s); refused 1." and "Traceback" not in err
    assert DeadLetter.objects.get(pk=record.pk).status == "open"
    # And a dry run says it would refuse it, exit 1
    process = manage("guardrails_replay", "--reason", "not_idempotent", "--dry-run")
    out, err = process.communicate(timeout=BOUND)
    assert process.returncode == 1, (out, err)
    assert err.startswith(f"would refuse {record.pk}: example_project.shop.tasks.send_receipt[task-1]: {refusal}"), err
    assert out.strip() == "0 dead letter(s) would be replayed, 1 refused."
    # And with the flag the dry run would replay it, exit 0
    process = manage("guardrails_replay", "--reason", "not_idempotent", "--dry-run", "--allow-not-idempotent")
    out, err = process.communicate(timeout=BOUND)
    assert process.returncode == 0, (out, err)
    assert out.splitlines() == [
        f"would replay {record.pk}: example_project.shop.tasks.send_receipt[task-1] not_idempotent",
        "1 dead letter(s) would be replayed, 0 refused.",
    ]
    assert DeadLetter.objects.get(pk=record.pk).status == "open"


def test_the_replay_help_says_what_allow_not_idempotent_means() -> None:
    from django.core.management import load_command_class

    command = load_command_class("django_celery_guardrails", "guardrails_replay")
    text = " ".join(command.create_parser("manage.py", "guardrails_replay").format_help().split())
    assert (
        "--allow-not-idempotent Replay not_idempotent records too. Their task failed after it may already have acted "
        "(charged a card, sent a mail), and a replay runs it again: give this only once you checked that the effect "
        "did not happen. Without it they are refused and stay open."
    ) in text
    assert "not_idempotent records are refused unless --allow-not-idempotent is given." in text


def test_the_text_list_writes_moments_as_the_admin_does_and_the_json_as_iso_8601() -> None:
    # Given a record that last failed at 08:03 UTC
    letter(3)
    # When it is listed as text, and as JSON
    text, data = StringIO(), StringIO()
    call_command("guardrails_deadletters", "list", stdout=text)
    call_command("guardrails_deadletters", "list", "--json", stdout=data)
    # Then a person reads the moment as the admin's pages write it, and a program reads ISO 8601
    (line,) = [line for line in text.getvalue().splitlines() if "task-3" in line]
    assert "  2026-11-30 08:03:00 UTC  " in line, line
    assert json.loads(data.getvalue().splitlines()[0])["last_failed_at"] == "2026-11-30T08:03:00Z"
