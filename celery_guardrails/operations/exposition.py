"""Exposing the metrics: :func:`metrics_registry` (every prefork child's metrics summed from
``PROMETHEUS_MULTIPROC_DIR`` when it is set, else this process's own, each family named from the first scrape),
:func:`exposition` (its text), the collectors other modules add (:func:`register_collector`), and the worker
bootstep that serves it on ``metrics_port`` (:class:`MetricsEndpoint`). A prefork child that exits is marked
dead (its live gauges dropped). See :mod:`.metrics` for how to run a prefork worker with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from celery import bootsteps
from celery.signals import worker_process_shutdown

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.operations.instruments import FAMILIES, MULTIPROC_DIR, REGISTRY, recording_failed
from celery_guardrails.options import app_value

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry
except ImportError:  # the prometheus extra is not installed: metrics cannot be switched on
    prometheus_client = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Collector factories :func:`metrics_registry` adds to every registry it builds (state read from stores).
_collectors: list[Callable[[], Any]] = []


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A prefork child exits: its live gauges are dropped (prometheus_client's ``mark_process_dead``);
    its counters and histograms stay in the directory and keep counting in the sums."""
    if prometheus_client is None or not os.environ.get(MULTIPROC_DIR):
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())  # type: ignore[no-untyped-call]
    except Exception as error:
        recording_failed(error, "a child's exit", None)


worker_process_shutdown.connect(
    _on_child_exit, weak=False, dispatch_uid="celery_guardrails.operations.metrics.child_exit"
)


# Exposition


class _Declared:
    """Another collector's families, then each of :data:`FAMILIES` it did not yield, empty (HELP and TYPE lines,
    no sample): before the first task, and in multiprocess mode before a child recorded, the endpoint still
    names every family."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import Metric

        seen = set()
        for family in self.inner.collect():
            seen.add(family.name)
            yield family
        for name, (kind, doc) in FAMILIES.items():
            # prometheus_client names a counter's family without its "_total" (it adds it to the samples)
            family_name = name.removesuffix("_total") if kind == "counter" else name
            if family_name not in seen:
                yield Metric(family_name, doc, kind)


class _ThisProcess:
    """This process's metrics as a collector of another registry."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()  # type: ignore[no-any-return]


def register_collector(factory: Callable[[], Any]) -> None:
    """Add a collector, made by ``factory``, to every registry :func:`metrics_registry` builds (state read
    from the stores at scrape time, say)."""
    _collectors.append(factory)


class _SizedFiles:
    """prometheus_client's multiprocess collector, without the files a process has created and not yet sized.

    A prefork child's metric file is opened (empty) and then grown to its first size (``MmapedDict.__init__``);
    a scrape between the two read zero bytes and failed whole (``struct.error``, a 500 for every metric), seen
    with ``--max-tasks-per-child=1``, where children start all the time. Such a file holds nothing yet.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):  # as prometheus_client's own: the scrape fails (503), never an empty 200
            raise ValueError(f"{MULTIPROC_DIR}={path!r} is not a directory")
        self.path = path

    def collect(self) -> Any:
        import glob

        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for name in glob.glob(os.path.join(self.path, "*.db")):
            try:
                if os.path.getsize(name) >= 8:  # the 8-byte header that says how much of the file is used
                    files.append(name)
            except OSError:  # removed since (mark_process_dead of a live gauge's file)
                continue
        return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def metrics_registry() -> Any:
    """A registry to expose: every process's metrics summed from ``PROMETHEUS_MULTIPROC_DIR`` when it is set
    (prefork children, a multi-process web server), else this process's own; plus :func:`register_collector`'s.
    Built anew for each call, as prometheus_client's multiprocess docs ask (never the registry the metrics
    were created in)."""
    if prometheus_client is None:
        raise ConfigurationError("metrics", "needs prometheus-client: pip install 'celery-guardrails[prometheus]'")
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_DIR):
        registry.register(_Declared(_SizedFiles(os.environ[MULTIPROC_DIR])))
    else:
        registry.register(_Declared(_ThisProcess()))
    for factory in _collectors:
        registry.register(factory())
    return registry


def exposition(registry: Any = None) -> tuple[bytes, str]:
    """The text exposition of ``registry`` (default :func:`metrics_registry`) and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry if registry is not None else metrics_registry()), CONTENT_TYPE_LATEST


class MetricsEndpoint(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: the HTTP metrics endpoint on ``metrics_port``, in the main process only (a worker
    bootstep never runs in a pool child). Not being able to serve is logged, never a reason to stop the worker:
    its tasks matter more than their metrics."""

    label = "Guardrails metrics"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.server: Any = None
        app = parent.app
        if app_value(app, "metrics") and prometheus_client is None:
            raise ConfigurationError("metrics", "needs prometheus-client: pip install 'celery-guardrails[prometheus]'")
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        app = parent.app
        port = app_value(app, "metrics_port")
        if port is None:
            return
        if not app_value(app, "metrics"):
            logger.warning("celery-guardrails: metrics_port %s is set but metrics is off: no endpoint", port)
            return
        pool = str(getattr(parent, "pool_cls", "") or "").lower()
        if "prefork" in pool and not os.environ.get(MULTIPROC_DIR):
            logger.warning(
                "celery-guardrails: prefork pool without %s: the endpoint on port %s cannot see what the pool "
                "children record (it serves the main process's metrics only). Start the worker with, for example: "
                "rm -rf /tmp/celery-metrics && mkdir /tmp/celery-metrics && "
                "%s=/tmp/celery-metrics celery -A proj worker ...  (an empty directory at each start of the whole "
                "worker: files left from an earlier run would be summed in; one directory per worker), or run "
                "--pool threads",
                MULTIPROC_DIR,
                port,
                MULTIPROC_DIR,
            )
        try:
            self.server, _ = prometheus_client.start_http_server(port, registry=metrics_registry())
        except Exception:
            logger.exception("celery-guardrails: metrics endpoint not started on port %s", port)
            return
        logger.info("celery-guardrails: metrics on port %s", port)

    def stop(self, parent: Any) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
