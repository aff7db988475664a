"""The bounded walk over a value: a JSON-ready copy of an argument, a header or a record's data, with what a
redaction takes out of it (strings whole, as a record keeps them, or only their secret parts, as they are shown).
Iterative, never recursive, and never raising: past :data:`MAX_DEPTH` levels, :data:`MAX_VALUES` values or
:data:`MAX_CHARACTERS` characters, a marker that holds :data:`REDACTED` takes the place of what was left out, and
a value that is not JSON is kept as its redacted repr (:class:`Walked` says which happened).
"""

from __future__ import annotations

import itertools
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

REDACTED = "[redacted]"

#: Levels of nesting a walk goes into; a value deeper is replaced by :data:`CUT_DEEP` (documented in the README).
MAX_DEPTH = 64
#: Values (containers and the values in them) a walk visits at most; the rest is replaced by :data:`CUT_MANY`.
MAX_VALUES = 20_000
#: Characters of strings a walk searches at most (4 Mi); a string past that is replaced by :data:`CUT_LONG`.
MAX_CHARACTERS = 4 * 1024 * 1024
#: Markers of a cut walk: each holds REDACTED, so a replay with no sealed copy refuses the value.
CUT_DEEP = f"{REDACTED} (cut: nested deeper than {MAX_DEPTH} levels)"
CUT_MANY = f"{REDACTED} (cut: more than {MAX_VALUES} values)"
CUT_LONG = f"{REDACTED} (cut: past {MAX_CHARACTERS} characters of text)"
CUT_UNREADABLE = f"{REDACTED} (cut: a value that could not be read)"
#: The key a cut mapping gets for what was left out.
CUT_KEY = f"{REDACTED} (cut)"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Walked:
    """What a walk made of a value: JSON-ready; ``not_json`` when something was kept as its repr, ``cut`` when
    something was left out (too deep, too many values, too long)."""

    value: Any
    not_json: bool = False
    cut: bool = False


class _Shown(str):
    """A value that is not JSON, kept as its redacted repr: a string in JSON, its text unquoted in a repr."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str.__str__(self)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 4, 4096, 4096
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = _REPR.maxdeque = 100


def safe_repr(value: Any) -> str:
    """``repr(value)``, bounded; never raises (a repr that does is named by the value's type)."""
    try:
        return str(_REPR.repr(value))
    except Exception:
        try:
            name = type(value).__qualname__
        except Exception:
            name = "object"
        return f"<{name} object: repr() failed>"


class Recogniser(Protocol):
    """What a walk asks of a redactor (:class:`~.redaction.Redactor`): a key name that is a secret's, a text that
    holds one, the text without it."""

    @property
    def matcher(self) -> re.Pattern[str]: ...

    def changes(self, text: str) -> bool: ...

    def text(self, given: Any, *, keep: int | None = None, tail: bool = False) -> str: ...


class Walk:
    """One bounded, iterative walk (no recursion: a value nested 5,000 levels deep is cut at MAX_DEPTH)."""

    def __init__(self, redactor: Recogniser, *, whole: bool) -> None:
        self.redactor = redactor
        self.whole = whole
        self.values = 0
        self.characters = 0
        self.not_json = False
        self.cut = False

    def exhausted(self) -> bool:
        return self.values >= MAX_VALUES

    def walked(self, value: Any) -> Walked:
        """The walk of ``value``: its copy and what the walk met so far."""
        copy = self.copy(value)
        return Walked(value=copy, not_json=self.not_json, cut=self.cut)

    def copy(self, value: Any) -> Any:
        """The walked copy of ``value`` (its limits shared with the other values of this walk)."""
        box: list[Any] = [None]
        # Work: (value, depth, container, slot); the result of ``value`` goes to container[slot].
        work: list[tuple[Any, int, Any, Any]] = [(value, 0, box, 0)]
        while work:
            item, depth, container, slot = work.pop()
            try:
                container[slot] = self._visit(item, depth, work)
            except Exception:  # a mapping whose items() raises, a __len__ that lies: that value only is lost
                self.cut = True
                container[slot] = CUT_UNREADABLE
        return box[0]

    def _visit(self, value: Any, depth: int, work: list[tuple[Any, int, Any, Any]]) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            self.cut = True
            return CUT_MANY
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return self._string(value)
        if isinstance(value, int):
            if value.bit_length() > 10_000:  # Python refuses to print an int of more than 4,300 digits
                self.not_json = True
                return _Shown(f"<int of {value.bit_length()} bits>")
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            self.not_json = True  # NaN and infinity are not JSON (PostgreSQL refuses them in jsonb)
            return _Shown(repr(float(value)))
        if isinstance(value, Mapping | list | tuple):
            if depth >= MAX_DEPTH:
                self.cut = True
                return CUT_DEEP
            if isinstance(value, Mapping):
                return self._mapping(value, depth, work)
            return self._sequence(value, depth, work)
        self.not_json = True
        shown = safe_repr(value)
        self.characters += len(shown)
        return _Shown(self.redactor.text(shown) if self.characters <= MAX_CHARACTERS else CUT_LONG)

    def _string(self, value: str) -> Any:
        text = str.__str__(value)
        self.characters += len(text)
        if self.characters > MAX_CHARACTERS:
            self.cut = True
            return CUT_LONG
        if self.whole:
            return REDACTED if self.redactor.changes(text) else text
        return self.redactor.text(text)

    def _mapping(self, value: Mapping[Any, Any], depth: int, work: list[tuple[Any, int, Any, Any]]) -> Any:
        out: dict[Any, Any] = {}
        room = MAX_VALUES - self.values
        for key, item in itertools.islice(value.items(), room + 1):
            if len(out) >= room:
                self.cut = True
                out[CUT_KEY] = CUT_MANY
                break
            name = self._key(key, out)
            if isinstance(key, str) and self.redactor.matcher.search(key):
                out[name] = REDACTED
            else:
                out[name] = None
                work.append((item, depth + 1, out, name))
        return out

    def _key(self, key: Any, taken: Mapping[Any, Any]) -> Any:
        if isinstance(key, str):
            self.characters += len(key)
            if self.characters > MAX_CHARACTERS:
                self.cut = True
                name: Any = CUT_LONG
            else:
                name = self.redactor.text(str.__str__(key))
        elif key is None or isinstance(key, bool | int) or (isinstance(key, float) and math.isfinite(key)):
            return key if not isinstance(key, int) or key.bit_length() <= 10_000 else _Shown("<int key>")
        else:  # JSON keys are strings: a tuple, an object, NaN as a key is kept as its repr
            self.not_json = True
            name = _Shown(self.redactor.text(safe_repr(key)))
        number = 1
        unique = name
        while unique in taken:  # two keys that redact alike must not overwrite each other
            number += 1
            unique = type(name)(f"{name} #{number}")
        return unique

    def _sequence(self, value: list[Any] | tuple[Any, ...], depth: int, work: list[tuple[Any, int, Any, Any]]) -> Any:
        room = MAX_VALUES - self.values
        items = list(itertools.islice(value, room + 1))
        out: list[Any] = [None] * min(len(items), room)
        if len(items) > room:
            self.cut = True
            out.append(CUT_MANY)
        pair = len(value) == 2 and isinstance(items[0], str) and bool(self.redactor.matcher.search(items[0]))
        for index in range(len(out) - (1 if len(items) > room else 0)):
            if pair and index == 1:  # ("Authorization", "Bearer ..."): a header given as a pair
                out[index] = REDACTED
            else:
                work.append((items[index], depth + 1, out, index))
        return out
