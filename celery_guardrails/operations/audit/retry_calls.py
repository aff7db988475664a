"""What a task function's own code shows of its ``.retry(`` calls, for the retry rules: whether it calls
it, with which waits (none, or a constant ``countdown``: a fixed interval), under a broad ``except``, and with
which ``max_retries``. Read from the function's source with :mod:`ast` (its bytecode when there is no source),
once per function.
"""

from __future__ import annotations

import ast
import dis
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from types import CodeType, FunctionType
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryCode:
    """What a task function's own code shows of its ``.retry(`` calls (read with ``ast``, else its bytecode)."""

    calls: bool = False
    #: (line, countdown) of each call whose wait is fixed: a constant countdown, or None (default_retry_delay).
    fixed: tuple[tuple[int, float | None], ...] = ()
    #: A call under ``except Exception:``, ``except BaseException:`` or a bare ``except:``.
    on_any_error: bool = False
    #: The constants passed as ``max_retries=`` (None: for ever).
    max_retries: tuple[int | None, ...] = ()


_RETRY_CODE: dict[CodeType, RetryCode] = {}
#: The classes that mean "any error" in a retry policy.
BROAD = ("Exception", "BaseException")


def _broad(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        kind is None
        or (isinstance(kind, ast.Name) and kind.id in BROAD)
        or (isinstance(kind, ast.Attribute) and kind.attr in BROAD)
        for kind in kinds
    )


def _retry_calls(nodes: Iterable[ast.AST]) -> list[ast.Call]:
    return [
        node
        for top in nodes
        for node in ast.walk(top)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "retry"
    ]


def _read_retry_code(function: Any) -> RetryCode:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, ValueError, RecursionError):
        # No source (a function built at run time, a .pyc only): the bytecode shows the calls, not their waits.
        from celery_guardrails.runtime.effects import code_objects

        found = any(
            instruction.argval == "retry" and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
            for code in code_objects(function.__code__)
            for instruction in dis.get_instructions(code)
        )
        return RetryCode(calls=found)
    body = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)), tree)
    calls = _retry_calls([body])
    fixed: list[tuple[int, float | None]] = []
    max_retries: list[int | None] = []
    for call in calls:
        keywords = {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg}
        countdown = keywords.get("countdown")
        if "eta" in keywords:
            pass  # a computed time: not a fixed interval
        elif countdown is None:
            fixed.append((call.lineno, None))
        elif isinstance(countdown, ast.Constant) and isinstance(countdown.value, int | float):
            fixed.append((call.lineno, float(countdown.value)))
        limit = keywords.get("max_retries")
        if isinstance(limit, ast.Constant) and (limit.value is None or type(limit.value) is int):
            max_retries.append(limit.value)
    handlers = [node for node in ast.walk(body) if isinstance(node, ast.ExceptHandler) and _broad(node)]
    return RetryCode(
        calls=bool(calls),
        fixed=tuple(fixed),
        on_any_error=any(_retry_calls(handler.body) for handler in handlers),
        max_retries=tuple(max_retries),
    )


def retry_code(task: Any) -> RetryCode:
    """What the task function's code shows of its ``.retry(`` calls (computed once per function)."""
    from celery_guardrails.runtime.effects import body_function

    function = body_function(task)
    if not isinstance(function, FunctionType):
        return RetryCode()
    found = _RETRY_CODE.get(function.__code__)
    if found is None:
        found = _RETRY_CODE[function.__code__] = _read_retry_code(function)
    return found
