"""``manage.py guardrails_audit``: the deployment audit of the project's Celery app (see celery_guardrails.audit).

Prints per axis of the rubric its score (0 to 5) and the findings, each naming the task or setting to change
and how; ``--json`` prints the same as JSON. Exit status 1 when an axis scores below ``--min-score`` (default
3), for CI; the same findings are Django system checks (``manage.py check --deploy``, ``guardrails.W1xx``).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_guardrails.audit import as_json, audit, render
from celery_guardrails.exceptions import ConfigurationError

from ... import health


class Command(BaseCommand):
    help = "Score the Celery configuration and tasks on the rubric's axes (0 to 5), naming what to change."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
        parser.add_argument(
            "--min-score", default="3", help="Exit 1 when an axis scores below this, 0 to 5 (default 3)."
        )

    def handle(self, *args: Any, json: bool, min_score: str, **options: Any) -> None:
        if not min_score.isdigit() or not 0 <= int(min_score) <= 5:
            raise CommandError(f"--min-score {min_score!r}: give a whole number from 0 to 5")
        threshold = int(min_score)
        try:
            report = audit(health.celery_app())
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(as_json(report, min_score=threshold) if json else render(report, min_score=threshold))
        below = report.below(threshold)
        if below:
            names = ", ".join(f"{axis.title} {axis.score}" for axis in below)
            raise CommandError(f"below {threshold}: {names}", returncode=1)
