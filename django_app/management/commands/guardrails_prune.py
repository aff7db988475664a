"""``manage.py guardrails_prune``: delete idempotency records past their retention (cron, Kubernetes, beat)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...maintenance import prune


class Command(BaseCommand):
    help = (
        "Delete idempotency records, closed dead letters and old scheduled-run records past their retention "
        "(never open dead letters)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=float,
            default=None,
            help="Seconds, for every table (default: idempotency_retention, 7 days; dead_letter_retention, 90 days).",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count what would be deleted; delete nothing.")

    def handle(self, *args: Any, older_than: float | None, dry_run: bool, **options: Any) -> None:
        counts = prune(older_than=older_than, dry_run=dry_run)
        verb = "Would delete" if dry_run else "Deleted"
        self.stdout.write(
            f"{verb} {counts['idempotency_keys']} idempotency key(s), {counts['processed_messages']} "
            f"processed-message record(s), {counts['dead_letters']} closed dead letter(s) and "
            f"{counts['scheduled_runs']} scheduled-run record(s)."
        )
