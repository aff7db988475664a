"""The project's task modules, imported in a web process the way a worker imports them.

``app.autodiscover_tasks()`` only connects a handler: the modules it finds (``shop/tasks.py``) are imported when
``app.loader.import_default_modules()`` runs, and only a worker (and the outbox relay) runs it. A web process
(the admin's replay, ``manage.py guardrails_replay``, the metrics view's budget and circuit gauges) may look up
a task nobody imported there. :func:`import_task_modules` imports them once per app and process (with
``CELERY_IMPORTS`` and ``include``); a module that fails to import does not raise: the result names it, is
logged once as a warning, and the callers say it (a replay's refusal text, the metrics view's log), never a 500.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Why a task cannot be found, for a refusal: it was never imported here, which is not "no longer registered".
NOT_REGISTERED = "not registered in this process (not found by autodiscover_tasks, CELERY_IMPORTS or include)"

_lock = threading.Lock()  # a threaded web server: one request imports, the others wait for it
_ATTRIBUTE = "_guardrails_task_modules"  # the app's Discovery, once made


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """How importing the project's task modules went in this process."""

    #: The module whose import failed ("" when all were imported, or when it could not be told).
    module: str = ""
    #: ``Type: message`` of the import's error; "" when all were imported.
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def __str__(self) -> str:
        if self.ok:
            return "the project's task modules were imported"
        where = f" {self.module!r}" if self.module else ""
        return f"importing the task module{where} failed: {self.error}"


def in_a_worker(app: Any) -> bool:
    """Whether this process is a worker of ``app``, which imported the task modules as it started. Importing them
    again there is not harmless: Celery's Django fixup answers the import with ``django.setup()``, which applies
    ``LOGGING`` again, onto the ``sys.stderr`` the worker redirected into its own logger (worker_redirect_stdouts):
    from then on the worker's log lines were lost (seen in the demo: silent after the outbox relay met a task no
    worker had), and it runs the system checks once more."""
    return bool(getattr(app.loader, "worker_initialized", False))


def import_task_modules(app: Any) -> Discovery:
    """Import ``app``'s task modules as a worker does, once per app and process; never raises (see above)."""
    done = getattr(app, _ATTRIBUTE, None)
    if done is not None:
        return done  # type: ignore[no-any-return]
    if in_a_worker(app):
        return Discovery(module="", error="")  # imported as the worker started
    with _lock:
        done = getattr(app, _ATTRIBUTE, None)
        if done is None:
            done = _import(app)
            setattr(app, _ATTRIBUTE, done)
    return done


def _import(app: Any) -> Discovery:
    from django.urls import get_script_prefix, set_script_prefix

    from . import checks

    # Celery's Django fixup calls django.setup() before the import, which sets the script prefix to "/": put
    # back the one this request was served under, or reverse() in the rest of the request would lose it.
    prefix = get_script_prefix()
    # The fixup then runs the system checks, one of which imports the task modules: it reads what is there.
    checks._importing.on = True
    try:
        app.loader.import_default_modules()
    except Exception as exc:  # a project's module that fails to import: its bug, said where it is needed
        found = Discovery(module=_failed_module(exc), error=f"{type(exc).__name__}: {exc}")
        logger.warning("Tasks cannot be looked up in this process: %s", found, exc_info=True)
        return found
    finally:
        checks._importing.on = False
        set_script_prefix(prefix)
    return Discovery()


def _failed_module(exc: BaseException) -> str:
    """The module whose top level raised (the innermost ``<module>`` frame), else the file of a SyntaxError."""
    module = ""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_name == "<module>":
            module = str(frame.f_globals.get("__name__", ""))
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename  # it never ran: no frame of its own
    return module
