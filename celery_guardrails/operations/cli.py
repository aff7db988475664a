"""``celery -A proj guardrails ...``: the extension's Celery sub-commands.

Celery adds every click command of the ``celery.commands`` entry point group to its own command line
(``celery.bin.celery``, through click-plugins); ours is registered in setup.cfg as ``guardrails``. Celery has
loaded the app (``-A``) before a sub-command runs and passes it as ``ctx.obj.app``.

``status`` prints what :mod:`celery_guardrails.operations.status` reads: queues (depth, age of the oldest message), open
dead letters by owner, dependencies and schedule health; ``--json`` prints the same as JSON. ``--watch``
redraws every ``--interval`` seconds, with each queue's depth change per second, until Ctrl-C (exit 0);
``--count N`` stops after N reads. A single read that could not read a source (broker or store down) prints
what it could, names the source, and exits 1.

``audit`` grades the app's configuration, registered tasks and source (:mod:`celery_guardrails.operations.audit`): per
axis
of the rubric its score (0 to 5) and findings, each naming the task, setting or file to change and how, then the
average; ``--json`` prints the same as JSON. It exits 1 when the report misses the rubric's threshold, for CI: an
axis below ``--min-score`` (default 3) or an average below ``--min-average`` (default 4.0); 2 when the guardrails
settings themselves are invalid. ``--source DIR`` names the folder of the project's code (default: the current
directory, or Django's ``BASE_DIR``).

``job <id>`` prints one job (``task.submit()``) as the registered job book reads it
(:mod:`celery_guardrails.operations.job_text`): state, attempt, progress, times, error, its dead letter, and its
history; ``--json`` prints the same as JSON. Exit 1 when there is no such job; 2 when the app keeps no jobs (no
job book: the Django app is not installed, or Django is not set up by the app's module).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import click


@click.group(name="guardrails")
def guardrails() -> None:
    """celery-guardrails: status of queues, dead letters, dependencies and schedules; the deployment audit."""


@guardrails.command(name="status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--watch", is_flag=True, help="Read again every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="Seconds.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="Stop after this many reads.")
@click.option("-Q", "--queues", default="", help="More queues to read (comma-separated), besides the app's.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: bool, interval: float, count: int | None, queues: str) -> None:
    """Queue depth and oldest age, open dead letters by owner, dependencies, schedule health."""
    app = ctx.obj.app
    try:  # the app's task modules (include, imports), as a worker imports them: their dependencies are read
        app.loader.import_default_modules()
    except Exception as exc:  # a status read goes on with what it has
        click.echo(f"warning: importing the app's task modules failed: {exc!r}", err=True)
    names = [name.strip() for name in queues.split(",") if name.strip()]
    reads = count if count is not None else (None if watch else 1)
    try:
        failed = _loop(app, names, as_json=as_json, watch=watch, interval=interval, reads=reads)
    except KeyboardInterrupt:  # Ctrl-C ends a watch: a normal end, not an error
        click.echo("")
        return
    if failed and not watch:  # a script or a check can tell that what it printed is incomplete
        ctx.exit(1)


@guardrails.command(name="audit")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option(
    "--min-score",
    type=click.IntRange(min=0, max=5),
    default=3,
    show_default=True,
    help="Exit 1 when an axis scores below this.",
)
@click.option(
    "--min-average",
    type=click.FloatRange(min=0, max=5),
    default=4.0,
    show_default=True,
    help="Exit 1 when the average of the axes is below this.",
)
@click.option(
    "--source",
    type=click.Path(exists=True, file_okay=False, dir_okay=True),
    default=None,
    help="The folder of the project's code and tests (default: Django's BASE_DIR, else the current directory).",
)
@click.pass_context
def audit(ctx: click.Context, as_json: bool, min_score: int, min_average: float, source: str | None) -> None:
    """Score the configuration, tasks and source on the rubric's axes (0 to 5), with the findings."""
    from celery_guardrails.exceptions import ConfigurationError
    from celery_guardrails.operations import audit as audit_module

    app = ctx.obj.app
    try:  # imported here (audit imports them too) to say so when it fails: the grade misses those tasks
        app.loader.import_default_modules()
    except Exception as exc:
        click.echo(f"warning: importing the app's task modules failed: {exc!r}", err=True)
    try:
        report = audit_module.audit(app, source=source)
    except ConfigurationError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    text = (
        audit_module.as_json(report, min_score=min_score, min_average=min_average)
        if as_json
        else audit_module.render(report, min_score=min_score, min_average=min_average)
    )
    click.echo(text)
    if not report.passed(min_score=min_score, min_average=min_average):
        ctx.exit(1)


@guardrails.command(name="job")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def job(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """One job: its state, progress, times, error, dead letter and history."""
    from celery_guardrails.guardrails.jobs import registered_book
    from celery_guardrails.operations import job_text

    app = ctx.obj.app
    try:  # a Django project's app sets Django up as its modules are imported (Celery's Django fixup)
        app.loader.import_default_modules()
    except Exception as exc:
        click.echo(f"warning: importing the app's task modules failed: {exc!r}", err=True)
    book = registered_book()
    if book is None:
        click.echo(
            "error: this app keeps no jobs: add 'django_celery_guardrails' to INSTALLED_APPS and set "
            "DJANGO_SETTINGS_MODULE for the app's module (its Celery app sets Django up)",
            err=True,
        )
        ctx.exit(2)
    found = book.describe(job_id.strip())
    if found is None:
        click.echo(f"error: no job {job_text.shown(job_id)}", err=True)
        ctx.exit(1)
    click.echo(job_text.as_json(found) if as_json else job_text.render(found))


def _loop(app: Any, names: list[str], *, as_json: bool, watch: bool, interval: float, reads: int | None) -> bool:
    """Read and print ``reads`` times (None: until Ctrl-C); whether the last read missed a source."""
    # Ctrl-C ends the loop even if the KeyboardInterrupt it raises is swallowed on its way up (a library's retry
    # loop that catches too much): the flag is looked at before every read.
    stopping = threading.Event()
    interrupt = signal.getsignal(signal.SIGINT)

    def stop(signum: int, frame: Any) -> None:
        stopping.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, stop)
    try:
        # (status is imported in _reads, not at the top: Celery imports this module for every ``celery`` command)
        return _reads(app, names, as_json=as_json, watch=watch, interval=interval, reads=reads, stopping=stopping)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, interrupt)


def _reads(
    app: Any,
    names: list[str],
    *,
    as_json: bool,
    watch: bool,
    interval: float,
    reads: int | None,
    stopping: threading.Event,
) -> bool:
    from celery_guardrails.operations import status as status_module

    previous = None
    done = 0
    while (reads is None or done < reads) and not stopping.is_set():
        if done and stopping.wait(interval):
            break
        current = status_module.with_change(status_module.gather(app, queues=names), previous)
        text = status_module.as_json(current) if as_json else status_module.render(current)
        if watch and not as_json and sys.stdout.isatty():
            click.clear()
        click.echo(text)
        previous, done = current, done + 1
    return bool(previous is not None and previous.errors)
