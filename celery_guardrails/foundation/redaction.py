"""Redaction: secrets and personal data never reach a retained record, a log line, an alert or a result.

**By name.** Every value under a key whose name matches one of ``redact_keys`` (case-insensitive, anywhere in
the name, ``-``, ``_`` and a space alike: ``password``, ``db_password``, ``X-Auth-Token``, ``X-Api-Key``) is
replaced by ``REDACTED``, in nested mappings and lists too; so is the second item of a two-item list or tuple
whose first item is such a name (a header given as a pair: ``["authorization", "Bearer ..."]``). Positional
arguments are matched by their parameter name in the task's signature.

**By value.** A string is also searched for the value patterns below (:data:`VALUE_PATTERNS`, plus the
``redact_patterns`` option's regular expressions), for ``<key>=<value>``, ``<key>: <value>``,
``"<key>": "<value>"`` and ``("<key>", "<value>")`` pairs of a matching key, and for card numbers:

========================= =================================================== ==============================
pattern                   example                                             kept as
========================= =================================================== ==============================
``url_credentials``       ``postgresql://app:Sup3rS3cret@db/shop``            ``postgresql://app:[redacted]@db/shop``
``bearer_credentials``    ``Authorization: Bearer 9f8e7d6c5b4a``              ``Authorization: [redacted] [redacted]``
``stripe_key``            ``invalid key sk_live_4eC39HqLyjWDarjtT1zdp7dc``     ``invalid key [redacted]``
``aws_access_key``        ``AKIAIOSFODNN7EXAMPLE`` and, near it, a 40-character ``[redacted]`` (both)
                          secret ``wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY``
``github_token``          ``ghp_16C7e42F292c6912E7710c838347Ae178B4a``         ``[redacted]``
``slack_token``           ``xoxb-2048-1337-AbCdEfGhIjKlMnOp``                 ``[redacted]``
``google_api_key``        ``AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe``          ``[redacted]``
``jwt``                   ``eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl`` ``[redacted]``
``private_key``           ``-----BEGIN RSA PRIVATE KEY-----`` ... ``-----END`` ``[redacted]`` (the whole block)
                          ``RSA PRIVATE KEY-----``
``card_number``           ``4111 1111 1111 1111`` (13 to 19 digits, Luhn)     ``[redacted]``
========================= =================================================== ==============================

Free text (an exception's message, a traceback, a log line, an alert) keeps everything but the secret part
(:func:`redact_text`). An argument value is replaced **whole** (:func:`redact_arguments`, :func:`redact`):
a string with a secret anywhere in it becomes exactly ``REDACTED``, which a replay puts back from the sealed
copy (:func:`celery_guardrails.foundation.sealing.restore_redacted` restores only values that are exactly the
placeholder). A ``redact_patterns`` entry with a group named ``secret`` redacts only that group in free text.

**Bounded.** The walks never raise and never recurse: values nested deeper than :data:`MAX_DEPTH` levels,
past :data:`MAX_VALUES` values or past :data:`MAX_CHARACTERS` characters of strings are replaced by a marker
that holds ``REDACTED`` (so a replay without a sealed copy refuses it) and the result says it was cut. Values
that are not JSON (bytes, sets, objects, NaN, dict keys that are not strings) are kept as their redacted repr
and flagged; a repr that raises is named by its type. Every pattern is anchored on a literal or a word
boundary and bounded, so that redacting text takes linear time whatever it holds (tested with a megabyte of
each pattern's near-miss).

The value patterns are in :mod:`.redaction_patterns`, the bounded walk over values in :mod:`.redaction_walk`;
their names stay importable from here.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_guardrails.foundation.redaction_patterns import VALUE_PATTERNS, Span, ValuePattern, user_patterns
from celery_guardrails.foundation.redaction_walk import (
    CUT_DEEP,
    CUT_KEY,
    CUT_LONG,
    CUT_MANY,
    CUT_UNREADABLE,
    MAX_CHARACTERS,
    MAX_DEPTH,
    MAX_VALUES,
    REDACTED,
    Walk,
    Walked,
    safe_repr,
)
from celery_guardrails.options import APP, TASK, Option, app_value, declare, resolve

logger = logging.getLogger(__name__)

#: What is kept of a text whose redaction failed (it never does; this is the last guard).
WITHHELD = f"{REDACTED} (withheld: the redaction failed)"
#: Characters searched past the part of a text that is kept (see :meth:`Redactor.text`): a secret cut in two
#: by the cut is still recognised whole when it is shorter than this.
MARGIN = 8192

#: Default key fragments redacted (case-insensitive substrings; ``_``, ``-`` and a space alike).
DEFAULT_REDACT_KEYS = (
    "password",
    "passwd",
    "secret",
    "token",
    "authorization",
    "api_key",
    "apikey",
    "card",
    "cvv",
    "ssn",
    "iban",
    "credential",
    "private_key",
)


def _redact_keys(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple | set | frozenset) else None
    if items is None:
        raise ValueError(f"must be a list of key-name fragments (matched anywhere in a name), got {value!r:.80}")
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"fragments are non-empty strings, got {item!r:.80}")
    return tuple(items)


def _regexes(value: Any) -> tuple[re.Pattern[str], ...]:
    items = [value] if isinstance(value, str | re.Pattern) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"must be a list of regular expressions, got {type(value).__name__}")
    compiled = []
    for number, item in enumerate(items, start=1):
        # Never echo a pattern: it may spell out the secret it is there to hide; its place in the list names it.
        try:
            pattern = item if isinstance(item, re.Pattern) else re.compile(item)
        except (TypeError, re.error) as exc:
            raise ValueError(f"pattern {number} is not a regular expression: {exc}") from None
        if not isinstance(pattern.pattern, str):
            raise ValueError(f"pattern {number} is a bytes pattern; text is searched")
        if pattern.search("") is not None:
            raise ValueError(f"pattern {number} matches the empty string (every argument would be redacted)")
        compiled.append(pattern)
    return tuple(compiled)


#: The options redaction reads, declared into the one schema (celery_guardrails.options).
DECLARED = declare(
    Option(
        name="redact_keys",
        default=DEFAULT_REDACT_KEYS,
        doc="Key-name fragments (case-insensitive) whose values are replaced before a dead letter is stored. "
        "Empty is allowed, with a warning at start-up and in manage.py check: nothing is then redacted by name.",
        check=_redact_keys,
        scopes=frozenset({TASK, APP}),
    ),
    Option(
        name="redact_patterns",
        default=(),
        doc="Regular expressions of secrets recognised by their value, added to the built-in ones (URL "
        "credentials, bearer tokens, provider keys, JWTs, private key blocks, card numbers: see "
        "celery_guardrails.foundation.redaction). In free text"
        " the match is redacted (only its group named 'secret', "
        "when it has one); an argument holding a match is replaced whole. Keep them linear: no nested "
        "repetition.",
        check=_regexes,
        scopes=frozenset({TASK, APP}),
    ),
)


def _fragment(key: str) -> str:
    # "api_key" also matches "Api-Key", "apikey" and "api key": header names and settings spell it every way.
    return "[-_ ]?".join(re.escape(part) for part in re.split(r"[-_ ]+", key.strip()) if part)


def _matcher(keys: Iterable[str]) -> re.Pattern[str]:
    fragments = [f for f in (_fragment(str(k)) for k in keys) if f]
    return re.compile("|".join(fragments) or r"(?!x)x", re.IGNORECASE)


# A key=value pair: the key is tried only where a word starts (the lookbehind) and is matched against the keys
# afterwards, in Python. A pattern with the keys inside it, tried at every character of a long run of word
# characters, took quadratic time (20k characters of an exception: 25 s). The value is read only after a key
# that matches (see Redactor._pairs): "refused: password=x" must not read "password=x" as the value of
# "refused". A value redacted already is left as it is: redacting a text twice (a message, then the log line
# that quotes it) changes nothing.
_KEY = re.compile(r"""(?<![\w.-])["']?(?P<key>[\w.-]+)["']?\s*[:=]\s*""")
_VALUE = re.compile(r"""(?!\[redacted\])(?:"[^"]*"|'[^']*'|[^\s,;&)}\]]+)""")
# A pair in a list or a tuple, as its repr shows it: ('X-Api-Key', 'abc'), ["authorization", "Bearer x"].
_LISTED = re.compile(
    r"""[(\[]\s*(?P<q>["'])(?P<key>[^"'\n]{1,200})(?P=q)\s*,\s*(?P<secret>"[^"\n]{0,4096}"|'[^'\n]{0,4096}')"""
)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RedactedArguments:
    """A task call's arguments as a record keeps them: redacted and JSON-ready.

    ``as_repr``: they were not JSON and are kept as their (redacted) repr, not replayable from the record;
    ``cut``: part of them was left out (:data:`MAX_DEPTH`, :data:`MAX_VALUES`, :data:`MAX_CHARACTERS`), so the
    record does not hold them whole. Unpacks as ``args, kwargs, not_whole`` (``as_repr`` or ``cut``: what a
    record's ``arguments_are_repr`` says, replay then reads them from the sealed copy only)."""

    args: list[Any]
    kwargs: dict[str, Any]
    as_repr: bool = False
    cut: bool = False

    def __iter__(self) -> Iterator[Any]:
        return iter((self.args, self.kwargs, self.as_repr or self.cut))


def exception_name(exc: BaseException) -> str:
    """``module.QualName`` of ``exc``'s class."""
    kind = type(exc)
    return f"{getattr(kind, '__module__', None) or '?'}.{getattr(kind, '__qualname__', None) or kind.__name__}"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or what can be said of it when its ``__str__`` raises (any exception at all, a recursion):
    never raises, so a failure is recorded whatever its exception does."""
    try:
        text = str(exc)
    except Exception as error:
        return f"<{exception_name(exc)}: its str() raised {type(error).__name__}>"
    return text if isinstance(text, str) else f"<{exception_name(exc)}>"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Redactor:
    """The redaction of one set of ``redact_keys`` and value patterns (made once per set: :func:`redactor`)."""

    keys: tuple[str, ...]
    patterns: tuple[ValuePattern, ...]
    matcher: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matcher", _matcher(self.keys))

    # Free text

    def text(self, given: Any, *, keep: int | None = None, tail: bool = False) -> str:
        """``given`` with every secret part replaced by ``REDACTED``; the rest kept. ``keep``: only that many
        characters are wanted (the first, or the last with ``tail``); :data:`MARGIN` more are searched, so that
        a secret the cut falls into is still found. Never raises."""
        try:
            text = str.__str__(given) if isinstance(given, str) else safe_repr(given)
            if keep is not None:
                text = text[-(keep + MARGIN) :] if tail else text[: keep + MARGIN]
            spans = sorted(s for s in self._spans(text) if s[0] < s[1])
            if spans:
                text = _replaced(text, spans)
            if keep is not None:
                text = text[-keep:] if tail else text[:keep]
            return text
        except Exception:  # never a secret for an error in the redaction itself: nothing of the text is kept
            logger.error("Redaction of a text failed; it is withheld")  # no traceback: its frames hold the text
            return WITHHELD

    def changes(self, text: str) -> bool:
        """Whether ``text`` holds anything :meth:`text` would redact."""
        return any(s[0] < s[1] for s in self._spans(text))

    def _spans(self, text: str) -> Iterator[Span]:
        if not text:
            return
        lowered = ""  # made once, for the first pattern whose hints are in lower case
        for pattern in self.patterns:
            hints = pattern.hints
            if hints:
                if pattern.folded and not lowered:
                    lowered = text.lower()
                seen = lowered if pattern.folded else text
                for hint in hints:
                    if hint in seen:
                        break
                else:
                    continue
            yield from pattern.spans(text)
        if "=" in text or ":" in text:
            yield from self._pairs(text)
        if "(" in text or "[" in text:
            matches = self.matcher.search
            for match in _LISTED.finditer(text):
                if matches(match.group("key")):
                    yield match.span("secret")

    def _pairs(self, text: str) -> Iterator[Span]:
        """The values of ``key=value`` pairs whose key matches. Linear: the search goes on right after the
        separator of a key that does not match, and after the value of one that does (read once)."""
        matches = self.matcher.search
        position = 0
        while (pair := _KEY.search(text, position)) is not None:
            position = pair.end()
            if matches(pair.group("key")) and (value := _VALUE.match(text, position)) is not None:
                yield value.span()
                position = value.end()

    # Values

    def value(self, value: Any) -> Walked:
        """``value`` as an argument or a header is kept (see the module docstring: strings with a secret are
        replaced whole)."""
        return Walk(self, whole=True).walked(value)

    def shown(self, value: Any) -> Walked:
        """``value`` as it may be shown (an alert, a log record's data, an exception's arguments): strings
        lose their secret parts only."""
        return Walk(self, whole=False).walked(value)

    def arguments(self, run: Any, args: Any, kwargs: Any) -> RedactedArguments:
        """A task call's arguments as a record keeps them (positional ones matched by parameter name too)."""
        try:
            return self._arguments(run, args, kwargs)
        except Exception:  # the walk does not raise; this is the last guard of a record that must be written
            logger.error("Redaction of a call's arguments failed; they are withheld")
            return RedactedArguments(args=[CUT_UNREADABLE], kwargs={}, as_repr=True, cut=True)

    def _arguments(self, run: Any, args: Any, kwargs: Any) -> RedactedArguments:
        try:
            names = [
                p.name
                for p in inspect.signature(run).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except Exception:  # no signature (a C function, a broken __signature__): by value only
            names = []
        # A tampered message's arguments that are not a list and a mapping: kept as values, flagged.
        malformed = not (args is None or isinstance(args, list | tuple)) or not (
            kwargs is None or isinstance(kwargs, Mapping)
        )
        args = [] if args is None else args if isinstance(args, list | tuple) else [args]
        kwargs = {} if kwargs is None else kwargs if isinstance(kwargs, Mapping) else {"kwargs": kwargs}
        walk = Walk(self, whole=True)
        clean_args: list[Any] = []
        for index, arg in enumerate(args):
            if walk.exhausted():
                clean_args.append(CUT_MANY)
                walk.cut = True
                break
            named = index < len(names) and self.matcher.search(names[index])
            clean_args.append(REDACTED if named else walk.copy(arg))
        clean_kwargs = walk.copy(kwargs)
        if walk.not_json or malformed:
            # Not JSON: keep a (redacted) repr so the record still says what it was; replay is not possible.
            return RedactedArguments(
                args=[safe_repr(clean_args)[:2000]],
                kwargs={"repr": safe_repr(clean_kwargs)[:2000]},
                as_repr=True,
                cut=walk.cut,
            )
        return RedactedArguments(args=clean_args, kwargs=clean_kwargs, as_repr=False, cut=walk.cut)


def _replaced(text: str, spans: list[Span]) -> str:
    parts: list[str] = []
    position = 0
    start, end = spans[0]
    for next_start, next_end in itertools.chain(spans[1:], [(len(text) + 1, len(text) + 1)]):
        if next_start <= end:  # overlapping or touching: one placeholder
            end = max(end, next_end)
            continue
        parts.append(text[position:start])
        parts.append(REDACTED)
        position = end
        start, end = next_start, next_end
    parts.append(text[position:])
    return "".join(parts)


@functools.lru_cache(maxsize=64)
def redactor(keys: tuple[str, ...] = DEFAULT_REDACT_KEYS, extra: tuple[re.Pattern[str], ...] = ()) -> Redactor:
    """The redactor of ``keys`` with the built-in value patterns and ``extra`` (``redact_patterns``), made once per
    set (every log line of a guarded task asks for its task's)."""
    return Redactor(keys=tuple(str(k) for k in keys), patterns=(*VALUE_PATTERNS, *user_patterns(extra)))


#: The built-in redaction: the default keys and the built-in value patterns only.
DEFAULT = redactor()


def for_task(task: Any) -> Redactor:
    """The redactor of ``task``'s ``redact_keys`` and ``redact_patterns`` (task, then app, then default). Never
    raises: a setting that cannot be read gives the defaults (a failure is never lost over its redaction)."""
    try:
        # No per-call values: a message cannot turn its own redaction off (neither option is per call).
        return redactor(tuple(resolve(task, "redact_keys", {})), tuple(resolve(task, "redact_patterns", {})))
    except Exception:
        logger.warning("Redaction settings of %s could not be read; the defaults apply", getattr(task, "name", "?"))
        return DEFAULT


def for_app(app: Any) -> Redactor:
    """The redactor of ``app``'s ``redact_keys`` and ``redact_patterns``; the defaults when they cannot be read."""
    try:
        return redactor(tuple(app_value(app, "redact_keys")), tuple(app_value(app, "redact_patterns")))
    except Exception:
        return DEFAULT


def redacted_error(task: Any, exc: BaseException, *, keep: int | None = None) -> str:
    """``"<Type>: <message>"`` of ``exc`` as a guarded task's row or line may keep it: redacted by the task's
    settings, ``keep`` characters at most. Never raises."""
    return for_task(task).text(f"{type(exc).__name__}: {exception_text(exc)}", keep=keep)


def redact_text(text: str, keys: Iterable[str] = DEFAULT_REDACT_KEYS, patterns: Iterable[re.Pattern[str]] = ()) -> str:
    """``text`` with its secrets replaced by ``REDACTED``, the rest kept (see the module docstring)."""
    return redactor(tuple(keys), tuple(patterns)).text(text)


def redact(value: Any, keys: Iterable[str] = DEFAULT_REDACT_KEYS, patterns: Iterable[re.Pattern[str]] = ()) -> Any:
    """A JSON-ready copy of ``value`` with the values of matching keys, list pairs and strings holding a secret
    replaced whole, at any depth (bounded: see the module docstring)."""
    return redactor(tuple(keys), tuple(patterns)).value(value).value


def redact_arguments(
    run: Any,
    args: Any,
    kwargs: Any,
    keys: Iterable[str] = DEFAULT_REDACT_KEYS,
    patterns: Iterable[re.Pattern[str]] = (),
) -> RedactedArguments:
    """Redacted, JSON-ready arguments of a task call (unpacks as ``args, kwargs, not_whole``)."""
    return redactor(tuple(keys), tuple(patterns)).arguments(run, args, kwargs)


# The names other modules read from here (their code is in the modules named in the docstring).
__all__ = [
    "CUT_DEEP",
    "CUT_KEY",
    "CUT_LONG",
    "CUT_MANY",
    "CUT_UNREADABLE",
    "DEFAULT",
    "DEFAULT_REDACT_KEYS",
    "MARGIN",
    "MAX_CHARACTERS",
    "MAX_DEPTH",
    "MAX_VALUES",
    "REDACTED",
    "VALUE_PATTERNS",
    "WITHHELD",
    "RedactedArguments",
    "Redactor",
    "ValuePattern",
    "Walked",
    "exception_name",
    "exception_text",
    "for_app",
    "for_task",
    "redact",
    "redact_arguments",
    "redact_text",
    "redacted_error",
    "redactor",
    "safe_repr",
    "user_patterns",
]
