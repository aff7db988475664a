"""``manage.py guardrails_audit``: the deployment audit of the project's Celery app (see
celery_guardrails.operations.audit).

Prints per axis of the rubric its score (0 to 5) and the findings, each naming the task, setting or file to
change and how, then the average; ``--json`` prints the same as JSON. Exit status 1 when the report misses the
rubric's threshold, for CI: an axis below ``--min-score`` (default 3) or an average below ``--min-average``
(default 4.0). ``--source DIR``: the folder of the project's code and tests (default: ``BASE_DIR``; its parent
for the tests when it holds none). The same findings are Django system checks (``manage.py check --deploy``,
``guardrails.W1xx``).
"""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.operations.audit import as_json, audit, render

from ... import health
from ...display import escape
from ..arguments import whole_number


class Command(BaseCommand):
    help = "Score the Celery configuration and tasks on the rubric's axes (0 to 5), naming what to change."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
        parser.add_argument(
            "--min-score", default="3", help="Exit 1 when an axis scores below this, 0 to 5 (default 3)."
        )
        parser.add_argument(
            "--min-average", default="4.0", help="Exit 1 when the axes' average is below this, 0 to 5 (default 4.0)."
        )
        parser.add_argument(
            "--source", default=None, help="The folder of the project's code and tests (default: BASE_DIR)."
        )

    def handle(
        self, *args: Any, json: bool, min_score: str, min_average: str, source: str | None, **options: Any
    ) -> None:
        score = whole_number(min_score, option="--min-score", minimum=0, maximum=5)
        try:
            average = float(min_average)
        except ValueError:
            average = -1.0
        if not 0 <= average <= 5:  # also refuses nan
            raise CommandError(f"--min-average {min_average!r}: give a number from 0 to 5")
        if source is not None and not os.path.isdir(source):
            raise CommandError(f"--source {source!r}: not a folder")
        try:
            report = audit(health.celery_app(), source=source)
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            as_json(report, min_score=score, min_average=average)
            if json
            # (the findings name tasks, settings and files: their control and invisible characters written out)
            else escape(render(report, min_score=score, min_average=average), multiline=True)
        )
        failures = report.failures(min_score=score, min_average=average)
        if failures:
            raise CommandError("; ".join(failures), returncode=1)
