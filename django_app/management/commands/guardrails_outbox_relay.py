"""``manage.py guardrails_outbox_relay``: publish the transactional outbox's messages (see
:mod:`django_celery_guardrails.outbox`), where the workers' relay thread is off (``outbox_relay=False``) or as a
process of its own. ``--once`` publishes what is due now and exits (the count printed); without it, it relays
until stopped (SIGTERM or Ctrl-C end it after the batch under way). ``--batch`` (1 to 10,000) and
``--interval`` (an age, at most a day) are checked like every command's values (a one-line error, exit 1).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from celery import current_app
from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_guardrails.options import app_value
from celery_guardrails.runtime.outbox import RelayPublisher

from ...outbox import relay, relay_loop
from ..arguments import AGE_HELP, age, whole_number

#: The largest --batch: one pass claims and publishes at most this many messages.
MAX_BATCH = 10_000
#: The longest --interval, in seconds.
MAX_INTERVAL = 86_400.0


class Command(BaseCommand):
    help = "Publish the outbox's messages whose transaction committed (once, or until stopped)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Publish what is due now, then exit.")
        parser.add_argument(
            "--batch", default=None, help=f"Messages per pass, 1 to {MAX_BATCH:,} (default: outbox_batch)."
        )
        parser.add_argument(
            "--interval",
            default=None,
            metavar="AGE",
            help=f"Wait between passes when idle, {AGE_HELP}; at most a day (default: outbox_relay_interval).",
        )

    def handle(self, *args: Any, once: bool, batch: str | None, interval: str | None, **options: Any) -> None:
        size = None if batch is None else whole_number(batch, option="--batch", minimum=1, maximum=MAX_BATCH)
        wait = None if interval is None else age(interval, option="--interval").total_seconds()
        if wait is not None and not 0 < wait <= MAX_INTERVAL:
            raise CommandError(f"--interval {interval!r}: give a positive age of at most a day")
        self._run(once, size, wait)

    def _run(self, once: bool, batch: int | None, interval: float | None) -> None:
        app = current_app._get_current_object()
        app.loader.import_default_modules()  # the project's tasks, as a worker imports them
        if once:
            published = failed = dead = 0
            publisher = RelayPublisher(app)
            try:
                while True:
                    done = relay(
                        app,
                        batch=batch or 100,
                        lease=app_value(app, "outbox_relay_lease"),
                        publisher=publisher,
                    )
                    published, failed = published + done.published, failed + done.failed
                    dead += done.dead_lettered
                    if done.handled < (batch or 100) or done.failed:
                        break
            finally:
                publisher.close()
            self.stdout.write(
                f"Published {published} outbox message(s); {failed} failed (kept, backed off); {dead} "
                "dead-lettered (unpublishable)."
            )
            return
        stopping = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stopping.set())
        self.stdout.write("Relaying the outbox until stopped.")
        relay_loop(app, stopping, interval=interval, batch=batch)
        self.stdout.write("Stopped.")
