"""``manage.py guardrails_deadletters``: dead letters from a shell (list, causes, show, discard, resolve, reseal,
fingerprint).

``list`` and ``show`` print a table or, with ``--json``, JSON for scripts (arguments as recorded: redacted;
a sealed copy is never printed). Text output writes control and invisible characters of stored values as
escapes (:mod:`django_celery_guardrails.display`: a carriage return or a bidi override cannot forge or reverse
a line); JSON escapes them itself. ``show`` says what a replay would do, as the replay decides it
(:func:`~django_celery_guardrails.replay.outlooks`). ``discard`` and ``resolve`` close open records, as the
admin's actions do.
``causes`` lists the biggest causes of open records (their fingerprints), as the admin's overview does; ``list
--fingerprint`` lists one cause's records. ``fingerprint`` fills in the fingerprint of records made before
fingerprints existed (in batches; safe beside running workers and to run again).
``reseal`` seals every sealed copy again with the first of ``seal_keys`` (key rotation: put the new key
first, run this, then drop the old key). Bad input is a one-line error and exit status 1.
"""

from __future__ import annotations

import getpass
import json
from dataclasses import asdict
from typing import Any

from celery import current_app
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.serializers.json import DjangoJSONEncoder

from celery_guardrails.exceptions import SealError
from celery_guardrails.foundation.sealing import sealer_for
from celery_guardrails.log import moment_text
from celery_guardrails.runtime.outcomes import REASONS

from ...display import escape
from ...maintenance import close_dead_letters, fill_fingerprints
from ...models import DeadLetter, SealedMessage
from ...overview import causes
from ...replay import outlooks
from ..arguments import AGE_HELP, DIGITS, choice, since, text, whole_number

#: Fields of a record in ``list`` (``show`` prints every field).
LISTED = ("id", "task_name", "reason", "status", "owner", "tenant", "attempts", "last_failed_at", "task_id")
STATUSES = [value for value, _ in DeadLetter.Status.choices]
#: A record id: digits a bigint holds.
#: Characters of ``--by`` the record keeps (its handled_by column).
BY_LENGTH = DeadLetter._meta.get_field("handled_by").max_length or 150
#: The most records ``list`` prints.
MAX_LIMIT = 1_000_000
#: Fields ``show`` prints on several lines.
MULTILINE = ("exc_message", "traceback")


class Command(BaseCommand):
    help = (
        "List, show, discard or resolve dead letters, list their causes; reseal their sealed copies after a key "
        "rotation; fill in the fingerprints of records made before fingerprints."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(
            dest="command", metavar="{list,causes,show,discard,resolve,reseal,fingerprint}"
        )
        commands.required = True
        listing = commands.add_parser("list", help="Records, newest failure first.")
        listing.add_argument("--status", default="open", help=f"One of {', '.join(STATUSES)} or all (default open).")
        listing.add_argument("--reason", help=f"Only this reason: {', '.join(REASONS)}.")
        listing.add_argument("--task", help="Only this task name.")
        listing.add_argument("--owner", help="Only this owner.")
        listing.add_argument("--tenant", help="Only this tenant.")
        listing.add_argument("--fingerprint", help="Only this cause (a fingerprint `causes` lists).")
        listing.add_argument("--since", help=f"Only failures since an ISO date/time or {AGE_HELP}.")
        listing.add_argument("--limit", default="50", help="At most this many records (default 50).")
        listing.add_argument("--json", action="store_true", help="JSON lines, one record each.")
        show = commands.add_parser("show", help="One record, every field.")
        show.add_argument("id", help="The record's id.")
        show.add_argument("--json", action="store_true", help="One JSON object.")
        for name, verb in (("discard", "Discard"), ("resolve", "Mark resolved")):
            closing = commands.add_parser(name, help=f"{verb} open records.")
            closing.add_argument("ids", nargs="+", help="Record ids.")
            closing.add_argument("--by", default="", help="Who did it (default: the shell user).")
            closing.add_argument("--json", action="store_true", help="One JSON object: what changed.")
        commands.add_parser("reseal", help="Seal every sealed copy again with the first of seal_keys.")
        grouped = commands.add_parser("causes", help="The biggest causes of open records, biggest first.")
        grouped.add_argument("--limit", default="20", help="At most this many causes (default 20).")
        grouped.add_argument("--json", action="store_true", help="JSON lines, one cause each.")
        commands.add_parser("fingerprint", help="Fill in the fingerprint of records made before fingerprints.")

    def handle(self, *args: Any, command: str, **options: Any) -> None:
        if command == "list":
            self._list(options)
        elif command == "show":
            self._show(_id(options["id"]), as_json=options["json"])
        elif command in ("discard", "resolve"):
            ids = [_id(value) for value in options["ids"]]
            by = text(options["by"], option="--by", max_length=BY_LENGTH, controls=False) or _shell_user()
            self._close(command, ids, by[:BY_LENGTH], as_json=options["json"])
        elif command == "causes":
            self._causes(options)
        elif command == "fingerprint":
            self.stdout.write(f"Filled in the fingerprint of {fill_fingerprints()} dead letter(s).")
        else:
            self._reseal()

    def _list(self, options: dict[str, Any]) -> None:
        records = DeadLetter.objects.all()
        status = choice(options["status"], [*STATUSES, "all"], option="--status")
        if status != "all":
            records = records.filter(status=status)
        if options["reason"]:
            records = records.filter(reason=choice(options["reason"], REASONS, option="--reason"))
        for field in ("task", "owner", "tenant", "fingerprint"):
            if options[field]:
                value = text(options[field], option=f"--{field}")
                records = records.filter(**{"task_name" if field == "task" else field: value})
        if options["since"]:
            records = records.filter(last_failed_at__gte=since(options["since"], option="--since"))
        limit = whole_number(options["limit"], option="--limit", minimum=1, maximum=MAX_LIMIT)
        rows = list(records.order_by("-last_failed_at", "-pk").values(*LISTED)[:limit])
        if options["json"]:
            for row in rows:
                self.stdout.write(json.dumps(row, cls=DjangoJSONEncoder))
            return
        for row in rows:
            shown = {
                name: escape(row[name]) for name in ("status", "reason", "task_name", "task_id", "owner", "tenant")
            }
            self.stdout.write(
                f"{row['id']:>8}  {moment_text(row['last_failed_at'])}  {shown['status']:<9} "
                f"{shown['reason']:<22} {shown['task_name']}[{shown['task_id']}] owner={shown['owner'] or '-'} "
                f"tenant={shown['tenant'] or '-'} attempts={row['attempts']}"
            )
        self.stdout.write(f"{len(rows)} record(s).")

    def _causes(self, options: dict[str, Any]) -> None:
        limit = whole_number(options["limit"], option="--limit", minimum=1, maximum=MAX_LIMIT)
        found = causes(limit=limit)
        for cause in found:
            if options["json"]:
                self.stdout.write(json.dumps(asdict(cause), cls=DjangoJSONEncoder))
                continue
            self.stdout.write(
                f"{cause.fingerprint}  {cause.count:>8} open  {moment_text(cause.first_seen)} .. "
                f"{moment_text(cause.last_seen)}  {escape(cause.task_name)}: {escape(cause.title)}"
            )
        if not options["json"]:
            self.stdout.write(f"{len(found)} cause(s).")

    def _show(self, pk: int, *, as_json: bool) -> None:
        record = DeadLetter.objects.filter(pk=pk).values().first()
        if record is None:
            raise CommandError(f"no dead letter {pk}")
        record["sealed"] = SealedMessage.objects.filter(dead_letter_id=pk).exists()
        outlook = outlooks([pk])[pk]  # what replay would do, as replay decides it
        if as_json:
            replay = {"replayable": outlook.replayable, "refusal": outlook.refusal, "says": str(outlook)}
            self.stdout.write(json.dumps({**record, "replay": replay}, cls=DjangoJSONEncoder, indent=2))
            return
        for name, value in [*record.items(), ("replay", str(outlook))]:
            shown = json.dumps(value, cls=DjangoJSONEncoder) if isinstance(value, dict | list) else value
            self.stdout.write(f"{name}: {escape(shown, multiline=name in MULTILINE)}")

    def _close(self, command: str, ids: list[int], by: str, *, as_json: bool) -> None:
        missing = sorted(set(ids) - set(DeadLetter.objects.filter(pk__in=ids).values_list("pk", flat=True)))
        if missing:
            raise CommandError(f"no dead letter {', '.join(map(str, missing))}; nothing was changed")
        status = DeadLetter.Status.DISCARDED if command == "discard" else DeadLetter.Status.RESOLVED
        was_open = list(DeadLetter.objects.open().filter(pk__in=ids).values_list("pk", flat=True))
        close_dead_letters(DeadLetter.objects.filter(pk__in=was_open), status, by=by)
        changed = sorted(DeadLetter.objects.filter(pk__in=was_open, status=status).values_list("pk", flat=True))
        if as_json:
            self.stdout.write(json.dumps({"status": status.value, "changed": changed, "by": by}))
            return
        self.stdout.write(
            f"{status.capitalize()} {len(changed)} of {len(ids)} dead letter(s) (the others were not open)."
        )

    def _reseal(self) -> None:
        sealer = sealer_for(current_app._get_current_object())
        if sealer is None:
            raise CommandError("no seal_keys are configured (CELERY_GUARDRAILS['seal_keys'])")
        resealed, failed = 0, []
        for pk, token in SealedMessage.objects.order_by("pk").values_list("pk", "token").iterator():
            try:  # conditional: a copy deleted with its record or changed meanwhile is left as it is
                SealedMessage.objects.filter(pk=pk, token=token).update(token=sealer.reseal(token))
                resealed += 1
            except SealError:
                failed.append(pk)
        self.stdout.write(f"Sealed {resealed} copy(ies) again with the first key.")
        if failed:
            shown = ", ".join(map(str, failed[:20]))
            raise CommandError(f"{len(failed)} sealed copy(ies) open with none of the keys (dead letters {shown})")


def _id(value: str) -> int:
    if not DIGITS.fullmatch(value):
        raise CommandError(f"{value[:40]!r} is not a dead letter id (a whole number of at most 18 digits)")
    return int(value)


def _shell_user() -> str:
    try:
        return f"shell:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name in a container
        return "shell"
