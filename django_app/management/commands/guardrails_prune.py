"""``manage.py guardrails_prune``: delete records past their retention (cron, Kubernetes, beat)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...maintenance import prune
from ..arguments import AGE_HELP, age


class Command(BaseCommand):
    help = (
        "Delete idempotency records (and claims whose lease ran out long ago), closed and replayed dead letters, "
        "old scheduled-run records, stale checkpoints, lost slot holders, idle ordering keys and finished jobs "
        "past their retention (never open dead letters, never unfinished jobs)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            default=None,
            metavar="AGE",
            help=f"One age for every table: {AGE_HELP} (default: idempotency_retention, 7 days; "
            "dead_letter_retention, 90 days; the ledger's 90 days; activity_retention, 2 days; "
            "job_retention, 30 days).",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count what would be deleted; delete nothing.")

    def handle(self, *args: Any, older_than: str | None, dry_run: bool, **options: Any) -> None:
        seconds = None if older_than is None else age(older_than, option="--older-than").total_seconds()
        counts = prune(older_than=seconds, dry_run=dry_run)
        verb = "Would delete" if dry_run else "Deleted"
        self.stdout.write(
            f"{verb} {counts['idempotency_keys']} idempotency key(s), {counts['processed_messages']} "
            f"processed-message record(s), {counts['dead_letters']} closed dead letter(s) and "
            f"{counts['scheduled_runs']} scheduled-run record(s); {counts['checkpoints']} checkpoint(s), "
            f"{counts['lost_slot_holders']} lost slot holder(s) and {counts['ordering_keys']} idle ordering key(s); "
            f"{counts['activity_counts']} activity count(s), {counts['activity_batches']} activity batch id(s) and "
            f"{counts['queue_samples']} queue sample(s); {counts['jobs']} finished job(s)."
        )
