"""The kit's pytest plugin is inert until enabled, and each of the three ways enables it (pytest runs of their
own, in subprocesses, with the plugin as installed: through its pytest11 entry point)."""

from __future__ import annotations

import os

import pytest

#: A test that asks for the kit's fixture without enabling anything.
ASKS = """
def test_asks(guardrails_kit):
    pass
"""

#: A marked test whose kit is a stand-in (no worker needed to see that the marker enabled the plugin).
MARKED = """
import pytest

class StandIn:
    worker = "the worker"

@pytest.fixture
def guardrails_kit():
    return StandIn()

@pytest.mark.guardrails
def test_marked(request):
    assert request.config.pluginmanager.has_plugin("celery_guardrails.testing.plugin")
    assert request.getfixturevalue("guarded_worker") == "the worker"

def test_not_marked():
    pass
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # Outside this suite's Django settings: a project of its own
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    )
    return pytester


def test_installed_but_not_enabled_it_adds_no_fixture(run: pytest.Pytester) -> None:
    # Given the package installed (its entry point loaded) and nothing enabling the kit
    run.makepyfile(test_it=ASKS)
    result = run.runpytest_subprocess("-p", "no:django", "-p", "no:cacheprovider")
    # Then its fixtures do not exist, and nothing of it ran
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'guardrails_kit' not found*"])


def test_the_ini_option_enables_it(run: pytest.Pytester) -> None:
    run.makeini("[pytest]\nguardrails_kit = true\n")
    result = run.runpytest_subprocess("-p", "no:django", "--fixtures")
    result.stdout.fnmatch_lines(["*guardrails_kit*", "*guarded_worker*"])


def test_the_command_line_option_enables_it(run: pytest.Pytester) -> None:
    result = run.runpytest_subprocess("-p", "no:django", "--guardrails-kit", "--fixtures")
    result.stdout.fnmatch_lines(["*guardrails_kit*"])


def test_the_marker_enables_it(run: pytest.Pytester) -> None:
    run.makepyfile(test_it=MARKED)
    result = run.runpytest_subprocess("-p", "no:django", "--strict-markers")
    result.assert_outcomes(passed=2)


def test_pytest_plugins_enables_it_without_the_entry_point(run: pytest.Pytester) -> None:
    # Given the entry point disabled, and the kit listed in a conftest
    run.makeconftest('pytest_plugins = ["celery_guardrails.testing"]\n')
    run.makepyfile(test_it=MARKED)
    result = run.runpytest_subprocess("-p", "no:django", "-p", "no:celery_guardrails", "--strict-markers")
    result.assert_outcomes(passed=2)


def test_disabled_entry_point_leaves_the_marker_unknown(run: pytest.Pytester) -> None:
    run.makepyfile(test_it=MARKED)
    result = run.runpytest_subprocess("-p", "no:django", "-p", "no:celery_guardrails", "--strict-markers")
    result.stdout.fnmatch_lines(["*'guardrails' not found in `markers` configuration option*"])
