"""``manage.py guardrails_replay``: replay open dead letters, after the cause was fixed.

``not_idempotent`` records (their task may already have acted before it failed) are refused unless
``--allow-not-idempotent`` says the operator checked that the effect did not happen; ``--dry-run`` asks the
same question, so it says "would refuse" for them too."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_guardrails.exceptions import ContextError
from celery_guardrails.foundation.context import validate_tenant
from celery_guardrails.runtime.outcomes import REASONS

from ...bulk import Matching, start
from ...display import escape
from ...models import DeadLetter
from ...replay import BATCH, refusals, replay_dead_letters
from ..arguments import AGE_HELP, choice, since, text


class Command(BaseCommand):
    help = (
        f"Replay open dead letters (all of them, or those matching --task, --reason, --fingerprint, --since), {BATCH} "
        "at a time, "
        "printing progress. Exits 1 when a record was refused (each is named on stderr with the reason). "
        "not_idempotent records are refused unless --allow-not-idempotent is given."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--task", help="Only this task name.")
        parser.add_argument("--reason", help=f"Only this reason: {', '.join(REASONS)}.")
        parser.add_argument(
            "--fingerprint", help="Only this cause (a fingerprint `guardrails_deadletters causes` lists)."
        )
        parser.add_argument("--since", help=f"Only failures since an ISO date/time or {AGE_HELP}.")
        parser.add_argument("--tenant", help="Replay them as this tenant (e.g. missing_tenant records).")
        parser.add_argument(
            "--allow-not-idempotent",
            action="store_true",
            help=(
                "Replay not_idempotent records too. Their task failed after it may already have acted (charged a "
                "card, sent a mail), and a replay runs it again: give this only once you checked that the effect "
                "did not happen. Without it they are refused and stay open."
            ),
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Say what would be replayed or refused; publish nothing."
        )
        parser.add_argument(
            "--background",
            action="store_true",
            help=(
                "Replay them as a job on the workers (django_celery_guardrails.bulk_dead_letters), batch by batch "
                "with its progress, stopped between batches by a cancel; prints the job's id and returns."
            ),
        )

    def handle(self, *args: Any, dry_run: bool, allow_not_idempotent: bool, **options: Any) -> None:
        # One filter for both ways (the bulk job's, frozen to the records existing now)
        filters = {}
        if options["task"]:
            filters["task_name"] = text(options["task"], option="--task")
        if options["reason"]:
            filters["reason"] = choice(options["reason"], REASONS, option="--reason")
        if options["fingerprint"]:
            filters["fingerprint"] = text(options["fingerprint"], option="--fingerprint")
        if options["since"]:
            filters["failed_since"] = since(options["since"], option="--since").isoformat()
        tenant = options["tenant"] or None
        if tenant is not None:
            try:
                validate_tenant(tenant)
            except ContextError as exc:
                raise CommandError(f"--tenant: {exc}") from None
        matching = Matching.now(**filters)
        if options["background"]:
            self._background(matching, tenant=tenant, dry_run=dry_run, allow_not_idempotent=allow_not_idempotent)
            return
        ids = list(matching.records().order_by("pk").values_list("pk", flat=True))
        run = self._dry_run if dry_run else self._replay
        refused = run(ids, tenant, allow_not_idempotent)
        if refused:
            raise CommandError(f"{refused} dead letter(s) {'would be ' if dry_run else ''}refused (reasons above)")

    def _background(self, matching: Matching, *, tenant: str | None, dry_run: bool, allow_not_idempotent: bool) -> None:
        if tenant is not None or dry_run:
            raise CommandError("--background takes neither --tenant nor --dry-run (run those in the foreground)")
        job = start("replay", matching, user=None, allow_not_idempotent=allow_not_idempotent)
        self.stdout.write(
            f"Started job {job.pk}: replay of the open dead letters matching {matching.described()}; follow it with "
            f"`celery -A <app> guardrails job {job.pk}` or on the admin's Jobs page."
        )

    def _dry_run(self, ids: list[int], tenant: str | None, allow_not_idempotent: bool) -> int:
        refused = 0
        for record, why in refusals(ids, tenant=tenant, allow_not_idempotent=allow_not_idempotent):
            if why:
                refused += 1
                self.stderr.write(f"would refuse {record.pk}: {_named(record)}: {escape(why)}")
                continue
            self.stdout.write(f"would replay {record.pk}: {_named(record)} {escape(record.reason)}")
        self.stdout.write(f"{len(ids) - refused} dead letter(s) would be replayed, {refused} refused.")
        return refused

    def _replay(self, ids: list[int], tenant: str | None, allow_not_idempotent: bool) -> int:
        # A bar redrawn in place on a terminal; a line a batch in a log (cron, a Kubernetes job).
        redraw = self.stdout.isatty()

        def progress(done: int, total: int) -> None:
            bar = f"[{'#' * (20 * done // total):<20}] {done}/{total}"
            self.stdout.write(f"\r{bar}" if redraw else bar, ending="" if redraw else "\n")
            self.stdout.flush()

        result = replay_dead_letters(ids, tenant=tenant, allow_not_idempotent=allow_not_idempotent, progress=progress)
        for record_id, why in result.skipped:
            self.stderr.write(f"refused {record_id}: {escape(why)}")
        end_of_bar = "\n" if redraw else ""
        self.stdout.write(f"{end_of_bar}Replayed {len(result.replayed)} dead letter(s); refused {len(result.skipped)}.")
        return len(result.skipped)


def _named(record: DeadLetter) -> str:
    """``task[id]``, control and invisible characters escaped (a stored value must not forge a line)."""
    return f"{escape(record.task_name)}[{escape(record.task_id)}]"
