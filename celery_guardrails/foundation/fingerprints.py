"""Fingerprints: one short id for every dead letter of the same cause, so that 40,000 records from one outage read
as one group.

A fingerprint is the first 16 hex digits of a SHA-256 over four parts, each made stable across occurrences:

* the task's name;
* the exception's type (``module.Class``);
* its message, normalised (:func:`normalised`): quoted values, UUIDs, long hex ids, e-mail addresses and numbers
  become placeholders, and runs of white space one space, so "order 42 declined" and "order 977 declined" are one
  message, and "card '4242' expired" and "card '1881' expired" another;
* the frame where the failure left the task's own code (:func:`own_frame`): the innermost frame of the traceback
  in the task's module, else the innermost outside installed packages and the standard library, as
  ``path/of/module.py:function`` (no line number: an edit elsewhere in the file must not split a group; the
  directory a release is deployed under is left out).

It is computed from what the record keeps (the redacted message and traceback), so a record made before
fingerprints existed gets the same one when it is filled in later (``guardrails_deadletters fingerprint``).
"""

from __future__ import annotations

import hashlib
import re

#: Hex digits kept of the SHA-256.
LENGTH = 16
#: Characters of a message normalised at most (a record keeps 500): the rules below look around each match, and a
#: message of any length must cost a bounded time on the path that records a failure.
MESSAGE_CHARS = 1_000

# Order matters: a quoted value may hold a number or an id, a UUID holds hex runs and numbers.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"'[^'\n]*'"), "'<q>'"),
    (re.compile(r'"[^"\n]*"'), '"<q>"'),
    (re.compile(r"\b[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"), "<email>"),
    # A hex run with at least one digit and one letter among a-f (a hash, a request id), 8 characters or more.
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"(?<![A-Za-z])[-+]?\d+(?:[.,]\d+)*"), "<n>"),
    (re.compile(r"\s+"), " "),
)
# Indentation is spaces and tabs only: ``\s*`` would run on over every empty line after each line start.
_FRAME = re.compile(r'^[ \t]*File "(?P<path>[^"]+)", line \d+, in (?P<function>\S+)', re.MULTILINE)
#: Path parts of installed and standard-library code: not the task's own.
_NOT_OWN = ("site-packages", "dist-packages", "/lib/python", "\\lib\\python", "<frozen ", "<string>")


def normalised(message: str) -> str:
    """``message`` (its first :data:`MESSAGE_CHARS`) with what varies between occurrences of one cause replaced by
    placeholders."""
    text = message[:MESSAGE_CHARS]
    for pattern, placeholder in _RULES:
        text = pattern.sub(placeholder, text)
    return text.strip()


def _short(path: str, module: str) -> str:
    """``path`` from its module's top package on (``shop/tasks.py``), or its last two parts."""
    parts = path.replace("\\", "/").split("/")
    top = module.split(".", 1)[0]
    if top and top in parts[:-1]:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index(top) :])
    return "/".join(parts[-2:])


def own_frame(task_name: str, traceback: str) -> str:
    """``path:function`` of the innermost frame of ``traceback`` in the task's module (the dotted prefix of its
    name), else the innermost outside installed packages and the standard library; "" when there is none."""
    frames = [(m["path"], m["function"]) for m in _FRAME.finditer(traceback)]
    module = task_name.rpartition(".")[0]
    suffix = module.replace(".", "/") + ".py"
    for path, function in reversed(frames):
        if module and path.replace("\\", "/").endswith(suffix):
            return f"{_short(path, module)}:{function}"
    for path, function in reversed(frames):
        if not any(part in path for part in _NOT_OWN):
            return f"{_short(path, module)}:{function}"
    return ""


def fingerprint(*, task_name: str, exc_type: str, exc_message: str, traceback: str) -> str:
    """The fingerprint of a failure (see the module docstring)."""
    parts = (task_name, exc_type, normalised(exc_message), own_frame(task_name, traceback))
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "backslashreplace")).hexdigest()[:LENGTH]


__all__ = ["LENGTH", "MESSAGE_CHARS", "fingerprint", "normalised", "own_frame"]
