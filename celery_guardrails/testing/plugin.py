"""The test kit's fixtures and hooks (registered once the kit is enabled: see :mod:`celery_guardrails.testing`).

``guardrails_kit``
    A :class:`~celery_guardrails.testing.Kit` with its worker started: the project's Celery app (the ini
    option ``guardrails_app``, the marker's ``app=``, or the app Celery knows as current), run by
    ``celery worker`` on a queue of the kit's own, on the project's real broker and store. Under
    pytest-django the test is made transactional and the worker uses the test database.
``guarded_worker``
    The kit's :class:`~celery_guardrails.testing.GuardedWorker` (``kill()``, ``start()``, ``restart()``,
    ``stop()``, ``log``).
``guardrails_kit_app``
    The Celery app object; override it to give another.

A failed test that had a kit gets its worker's log in the report.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, cast

import pytest

import celery_guardrails.testing as testing
from celery_guardrails.testing import entry
from celery_guardrails.testing.current import set_current
from celery_guardrails.testing.kit import Kit
from celery_guardrails.testing.worker import Launcher, start_process

_kit_key = pytest.StashKey[Kit]()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if not pluginmanager.has_plugin("celery_guardrails"):  # the entry point adds them when it is loaded
        entry.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("celery_guardrails"):
        entry.pytest_configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-django, a test with a kit uses the test databases, transactionally (the worker is another
    process: it sees only what is committed). Marked here, at collection, because pytest-django creates only
    the databases the collected tests are marked for."""
    if not config.pluginmanager.has_plugin("django"):
        return
    for item in items:
        names = getattr(item, "fixturenames", ())
        wants_kit = item.get_closest_marker(entry.MARKER) or "guardrails_kit" in names or "guarded_worker" in names
        if wants_kit and item.get_closest_marker("django_db") is None:
            item.add_marker(pytest.mark.django_db(transaction=True, databases="__all__"))


def _marker(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``guardrails`` markers' keyword arguments, the closest marker's winning (the test's over its
    module's)."""
    found: dict[str, Any] = {}
    for mark in request.node.iter_markers(entry.MARKER):
        for name, value in mark.kwargs.items():
            found.setdefault(name, value)
    return found


def _ini(config: pytest.Config, name: str) -> str:
    try:
        return str(config.getini(name) or "")
    except ValueError:  # the options were never added (the entry point blocked): the defaults
        return ""


def app_path(app: Any) -> str:
    """Where ``celery -A`` finds ``app``: the module attribute that holds it (``module:attribute``)."""
    modules = sorted(sys.modules.items(), key=lambda item: (not item[0].endswith("celery"), len(item[0])))
    for name, module in modules:
        if module is None or name == "__main__":
            continue
        try:
            attributes = vars(module)
        except TypeError:
            continue
        for attribute, value in list(attributes.items()):
            if value is app and not attribute.startswith("_"):
                return f"{name}:{attribute}"
    raise testing.KitError(
        "the test kit cannot tell which module holds the Celery app: set guardrails_app in the pytest ini file "
        "(e.g. guardrails_app = proj.celery:app)"
    )


@pytest.fixture
def guardrails_kit_app(request: pytest.FixtureRequest) -> Any:
    from celery import current_app
    from celery.utils.imports import symbol_by_name

    path = _marker(request).get("app") or _ini(request.config, "guardrails_app")
    if path:
        found = symbol_by_name(path)
        if not hasattr(found, "conf"):  # a module: its app, as celery -A finds it
            found = getattr(found, "app", None) or getattr(found, "celery", None)
        return found
    return current_app._get_current_object()


def _databases(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The test databases the worker must use (pytest-django's), the test made transactional; {} without."""
    if not request.config.pluginmanager.has_plugin("django"):
        return {}
    from django.conf import settings

    if not settings.configured:
        return {}
    request.getfixturevalue("transactional_db")
    from django.db import connections

    found = {}
    for alias in connections:
        values = connections[alias].settings_dict
        name = str(values["NAME"])
        if "sqlite" in values["ENGINE"] and (name == ":memory:" or "mode=memory" in name):
            raise testing.KitError(
                f"the database {alias!r} is an in-memory SQLite test database, which the kit's worker (another "
                "process) cannot see: give DATABASES[{alias!r}]['TEST']['NAME'] a file name"
            )
        found[alias] = {
            "NAME": name,
            "ENGINE": values["ENGINE"],
            "HOST": values.get("HOST"),
            "PORT": values.get("PORT"),
        }
    return found


def _launcher(path: str) -> Launcher:
    """The ``guardrails_launcher`` ini option's callable (``module:callable``), or the default subprocess."""
    if not path:
        return start_process
    from celery.utils.imports import symbol_by_name

    try:
        found = symbol_by_name(path)
    except (ImportError, AttributeError, ValueError) as error:
        raise testing.KitError(f"guardrails_launcher = {path}: {error}") from error
    if not callable(found):
        raise testing.KitError(f"guardrails_launcher = {path}: not a callable")
    return cast(Launcher, found)


@pytest.fixture
def guardrails_kit(request: pytest.FixtureRequest, guardrails_kit_app: Any, tmp_path: Any) -> Iterator[Kit]:
    options = _marker(request)
    app = guardrails_kit_app
    path = options.get("app") or _ini(request.config, "guardrails_app") or app_path(app)
    folder = tmp_path / "guardrails-kit"
    folder.mkdir()
    kit = Kit(
        celery_app=app,
        app_path=path,
        folder=folder,
        pool=options.get("pool") or _ini(request.config, "guardrails_pool") or "prefork",
        concurrency=int(options.get("concurrency") or _ini(request.config, "guardrails_concurrency") or 2),
        databases=_databases(request),
        launcher=_launcher(_ini(request.config, "guardrails_launcher")),
    )
    request.node.stash[_kit_key] = kit
    set_current(kit)
    try:
        kit.start()
        yield kit
    finally:
        set_current(None)
        kit.close()


@pytest.fixture
def guarded_worker(guardrails_kit: Kit) -> Any:
    return guardrails_kit.worker


@pytest.fixture(autouse=True)
def _guardrails_kit_for_marked(request: pytest.FixtureRequest) -> None:
    """A test marked ``guardrails`` gets a kit without asking for the fixture (for the helper functions)."""
    if request.node.get_closest_marker(entry.MARKER) is not None:
        request.getfixturevalue("guardrails_kit")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    kit = item.stash.get(_kit_key, None)
    if report.failed and kit is not None:
        report.sections.append(("celery-guardrails kit worker", "\n".join(kit.worker.log.splitlines()[-200:])))
