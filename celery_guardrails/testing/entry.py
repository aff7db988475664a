"""The test kit's pytest entry point (``pytest11``): loaded by pytest wherever celery-guardrails is installed,
it adds the kit's options and marker and nothing else, until the kit is enabled (see
:mod:`celery_guardrails.testing`). Disable it altogether with ``-p no:celery_guardrails``."""

from __future__ import annotations

from typing import Any

import pytest

PLUGIN = "celery_guardrails.testing.plugin"
MARKER = "guardrails"


def add_options(parser: pytest.Parser) -> None:
    parser.addini("guardrails_kit", type="bool", default=False, help="celery-guardrails: enable the test kit")
    parser.addini(
        "guardrails_app",
        default="",
        help="celery-guardrails: the Celery app the kit's worker runs, as celery -A takes it (module or module:app)",
    )
    parser.addini("guardrails_pool", default="prefork", help="celery-guardrails: the kit worker's pool")
    parser.addini("guardrails_concurrency", default="2", help="celery-guardrails: the kit worker's concurrency")
    parser.addini(
        "guardrails_launcher",
        default="",
        help="celery-guardrails: what starts the kit's worker process (module:callable; default a subprocess)",
    )
    parser.getgroup("celery-guardrails").addoption(
        "--guardrails-kit", action="store_true", default=False, help="enable the celery-guardrails test kit"
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(app=None, pool=None, concurrency=None): run with the celery-guardrails test kit "
        "(a real worker of its own, and the fault helpers)",
    )
    if config.getini("guardrails_kit") or config.getoption("guardrails_kit"):
        enable(config)


def enable(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN):
        config.pluginmanager.import_plugin(PLUGIN)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any) -> None:
    """A test, class or module marked ``guardrails`` enables the kit before its items are made (so that their
    fixtures resolve)."""
    if collector.config.pluginmanager.has_plugin(PLUGIN):
        return
    own = getattr(obj, "pytestmark", [])
    marks = own if isinstance(own, list) else [own]
    if any(getattr(mark, "name", None) == MARKER for mark in marks) or collector.get_closest_marker(MARKER):
        enable(collector.config)
