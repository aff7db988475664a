"""The tests axis (GA8xx): whether the project's tests prove its guarded tasks on the rubric's bad days with the
test kit (:mod:`celery_guardrails.testing`). The test files are read, never imported
(:func:`celery_guardrails.operations.audit_source.read_tests`): no test file uses the kit, a guarded task no kit
test names (with the helper to start with), the tests not read whole.
"""

from __future__ import annotations

from typing import Any

from celery_guardrails.operations import audit_source
from celery_guardrails.operations.audit.model import ERROR, INFO, WARNING, Finding, finding
from celery_guardrails.options import resolve


def _first_helper(task: Any) -> str:
    """The kit's helper a task's first test starts with: the rubric's case its options are about."""
    from celery_guardrails.runtime.effects import body_function

    function = body_function(task)
    name = getattr(function, "__name__", None) or task.name.rpartition(".")[2]
    if resolve(task, "ordering_key", {}) is not None:
        return f"out_of_order({name}, [...]) (messages of one key delivered out of order)"
    if resolve(task, "accepts_versions", {}) is not None:
        return f"deploy_during_processing({name}, old=Release(...), new=Release(...)) (a deployment mid-queue)"
    return (
        f"deliver_twice({name}, ...) with assert_single_effect (a duplicate delivery), then crash_mid_task and poison"
    )


def _named_in(task: Any, names: frozenset[str]) -> bool:
    """Whether ``names`` (a kit test file's) name the task: its full name, the last part of it, its class, or its
    function (not a class-based task's ``run``, which names nothing)."""
    from celery_guardrails.runtime.effects import body_function

    function = getattr(body_function(task), "__name__", None)
    candidates = {task.name, task.name.rpartition(".")[2], type(task).__name__}
    if function and function != "run":
        candidates.add(function)
    return bool(candidates & names)


def kit_rules(guarded: list[Any], walked: audit_source.Walk) -> list[Finding]:
    """Tests (GA8xx): no kit test at all, a guarded task no kit test names, tests not read whole."""
    if not guarded:
        return []  # no guarded task, nothing for the kit to prove (GA101 names the plain ones)
    found = []
    if not walked.complete:
        found.append(
            finding(
                "GA809",
                INFO,
                "tests",
                f"the tests under {walked.root} were not read whole ({walked.why_incomplete}): what was not read "
                "is not graded",
                "point --source at the project, without virtualenvs or data folders",
            )
        )
    count, kit_files = audit_source.read_tests(walked)
    if not kit_files:
        seen = f"none of the {count} test files" if count else "no test file"
        found.append(
            finding(
                "GA801",
                ERROR,
                "tests",
                f"{seen} under {walked.root} uses the test kit (celery_guardrails.testing): no test delivers a "
                "guarded task twice, kills it mid-task or poisons it",
                "add tests marked @pytest.mark.guardrails that call the kit's helpers (from "
                "celery_guardrails.testing import deliver_twice, crash_mid_task, poison, ...): docs/testing.md",
            )
        )
    names = frozenset().union(*(kit_file.names for kit_file in kit_files))
    for task in guarded:
        if not _named_in(task, names):
            found.append(
                finding(
                    "GA802",
                    WARNING,
                    task.name,
                    "no test that uses the test kit names it: its behaviour on the rubric's bad days is not shown",
                    f"start with {_first_helper(task)}, in a test marked @pytest.mark.guardrails",
                )
            )
    return found
