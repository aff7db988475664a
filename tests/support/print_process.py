"""Run by tests/test_fork_server.py: prints what a process started as ``python -m`` (or ``python -c`` calling
:func:`main`) can see of itself."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    if sys.argv[1:] == ["--sleep"]:
        time.sleep(60)
    from django.conf import settings

    print(
        json.dumps(
            {
                "argv": sys.argv,
                "probe": os.environ.get("GUARDRAILS_FORK_PROBE"),
                "cwd": os.getcwd(),
                "path": sys.path,
                "pid": os.getpid(),
                "sid": os.getsid(0),
                "parent": os.getppid(),
                "settings_configured": settings.configured,
                "signals": {
                    name: str(signal.getsignal(getattr(signal, name)))
                    for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGXFSZ", "SIGHUP", "SIGUSR1")
                },
            }
        )
    )
    print("to stderr", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    main()
