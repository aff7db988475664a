"""``python -m tests.support.watchdog_loop``: the watchdog's check over and over, without waiting for a turn.

The tests app (``tests.proj.app``, configured from the environment like a worker) is checked as fast as the
store answers, the way ``manage.py guardrails_watchdog --loop`` or a cron job checks next to the workers'
watchdogs: two of these race each other (and beat) for the same periods. SIGTERM ends it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django

    django.setup()

from celery_guardrails.scheduling.watchdog import check
from tests.proj.app import app


def main() -> None:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    checks = 0
    while not stopping.is_set():
        check(app)
        checks += 1
        if checks == 1:
            print("watchdog loop: first check done", flush=True)
        time.sleep(0.01)
    print(f"watchdog loop: {checks} checks", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
