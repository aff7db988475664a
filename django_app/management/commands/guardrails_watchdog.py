"""``manage.py guardrails_watchdog``: check scheduled runs against the ledger (cron, Kubernetes CronJob).

The same check the workers' watchdog runs (see :mod:`celery_guardrails.scheduling.watchdog`): periods not dispatched
or not started within their grace are recorded missed, runs past max_runtime overdue, and each is alerted
once. Safe to run next to the workers' watchdog: each finding is recorded (and alerted) once.
"""

from __future__ import annotations

import time
from typing import Any

from celery import current_app
from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_guardrails.log import moment_text
from celery_guardrails.scheduling.watchdog import check

from ...display import escape
from ..arguments import AGE_HELP, age


class Command(BaseCommand):
    help = "Record and alert missed and overdue scheduled runs (the watchdog, once or every --loop seconds)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--loop", default=None, metavar="AGE", help=f"Check again every AGE until stopped ({AGE_HELP})."
        )

    def handle(self, *args: Any, loop: str | None, **options: Any) -> None:
        every = None if loop is None else age(loop, option="--loop").total_seconds()
        if every is not None and every <= 0:
            raise CommandError(f"--loop {loop!r}: give a positive age")
        try:
            self._run(every)
        except KeyboardInterrupt:  # Ctrl-C ends a --loop: a stop asked for, not an error
            self.stdout.write("Stopped.")

    def _run(self, every: float | None) -> None:
        app = current_app._get_current_object()
        while True:
            findings = check(app)
            for kind, found in (("missed", findings.missed), ("overdue", findings.overdue)):
                for schedule, period in found:
                    self.stdout.write(f"{kind}: {escape(schedule)} {moment_text(period)}")
            self.stdout.write(f"Recorded {len(findings.missed)} missed and {len(findings.overdue)} overdue run(s).")
            if every is None:
                return
            time.sleep(every)
