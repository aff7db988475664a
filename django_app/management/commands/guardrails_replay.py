"""``manage.py guardrails_replay``: replay open dead letters, after the cause was fixed."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from ...models import DeadLetter
from ...replay import replay_dead_letters


def since(value: str) -> datetime:
    """An ISO date/time, or an age such as 30m, 2h, 7d."""
    match = re.fullmatch(r"(\d+)([smhd])", value)
    if match:
        amount, unit = int(match[1]), match[2]
        return timezone.now() - timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[unit]: amount})
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise CommandError(f"--since {value!r}: give an ISO date/time or an age like 30m, 2h, 7d") from None
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


class Command(BaseCommand):
    help = "Replay open dead letters (all of them, or those matching --task, --reason, --since)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--task", help="Only this task name.")
        parser.add_argument("--reason", help="Only this reason (permanent, attempts_exhausted, poison, ...).")
        parser.add_argument("--since", type=since, help="Only failures since: ISO date/time or age (2h, 7d).")
        parser.add_argument("--dry-run", action="store_true", help="List what would be replayed; publish nothing.")

    def handle(
        self, *args: Any, task: str | None, reason: str | None, since: datetime | None, dry_run: bool, **options: Any
    ) -> None:
        records = DeadLetter.objects.open()
        if task:
            records = records.filter(task_name=task)
        if reason:
            records = records.filter(reason=reason)
        if since:
            records = records.filter(last_failed_at__gte=since)
        ids = list(records.order_by("pk").values_list("pk", flat=True))
        if dry_run:
            for record in DeadLetter.objects.filter(pk__in=ids).order_by("pk"):
                self.stdout.write(f"would replay {record.pk}: {record.task_name}[{record.task_id}] {record.reason}")
            self.stdout.write(f"{len(ids)} dead letter(s) would be replayed.")
            return
        replayed = skipped = 0
        for done, pk in enumerate(ids, start=1):
            result = replay_dead_letters([pk])
            replayed += len(result.replayed)
            skipped += len(result.skipped)
            for record_id, why in result.skipped:
                self.stderr.write(f"skipped {record_id}: {why}")
            self.stdout.write(f"\r[{'#' * (20 * done // len(ids)):<20}] {done}/{len(ids)}", ending="")
        self.stdout.write(f"\nReplayed {replayed} dead letter(s); skipped {skipped}.")
