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
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import re
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_guardrails.options import APP, TASK, Option, app_value, declare, resolve

logger = logging.getLogger(__name__)

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
#: What is kept of a text whose redaction failed (it never does; this is the last guard).
WITHHELD = f"{REDACTED} (withheld: the redaction failed)"
#: The key a cut mapping gets for what was left out.
CUT_KEY = f"{REDACTED} (cut)"
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

Span = tuple[int, int]


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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ValuePattern:
    """A secret recognised by its shape: ``regex`` finds it; the group named ``secret`` (when the regex has
    one) is the part free text loses, else the whole match; ``accept``, when given, must also say yes to that
    part (a card number's Luhn check). ``hints``: strings one of which every match holds (``folded``: in lower
    case), checked first (:meth:`Redactor.text`), so that most texts are never searched by the regex at all.
    Subclasses with a search of their own override :meth:`spans`."""

    name: str
    regex: re.Pattern[str]
    example: str = ""
    accept: Callable[[str], bool] | None = None
    hints: tuple[str, ...] = ()
    folded: bool = False

    def spans(self, text: str) -> Iterator[Span]:
        """(start, end) of each secret part in ``text`` (empty ones are skipped by the caller)."""
        secret = "secret" in self.regex.groupindex
        for match in self.regex.finditer(text):
            start, end = match.span("secret") if secret else match.span()
            if self.accept is None or self.accept(text[start:end]):
                yield start, end


_AWS_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
#: Characters around an access key id searched for its secret.
_AWS_NEAR = 200


class _AccessKey(ValuePattern):
    """An AWS access key id, and a 40-character secret within :data:`_AWS_NEAR` characters of one. The windows
    around the ids are merged first, so every character is searched once however many ids there are."""

    def spans(self, text: str) -> Iterator[Span]:
        window: list[int] | None = None
        for match in self.regex.finditer(text):
            yield match.span()
            start, end = max(0, match.start() - _AWS_NEAR), match.end() + _AWS_NEAR
            if window is not None and start <= window[1]:
                window[1] = end
                continue
            if window is not None:
                yield from self._secrets(text, *window)
            window = [start, end]
        if window is not None:
            yield from self._secrets(text, *window)

    @staticmethod
    def _secrets(text: str, start: int, end: int) -> Iterator[Span]:
        for found in _AWS_SECRET.finditer(text, start, min(end, len(text))):
            yield found.span()


_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----")
#: Characters of a private key block at most (a 16 kbit RSA key is about 12,000).
_PEM_LONGEST = 16_384
#: The body of a block whose END line is missing (a cut traceback): base64 lines and their headers.
_PEM_BODY = re.compile(rf"[A-Za-z0-9+/=\s:,.-]{{0,{_PEM_LONGEST}}}")


class _PrivateKey(ValuePattern):
    """A PEM private key block, BEGIN to END; without its END line (cut short), BEGIN and the base64 after it.

    Linear: the END line is searched for once per stretch of text (not once per BEGIN line), and a BEGIN line
    inside a block already found is skipped (a megabyte of BEGIN lines is searched once, not a million times)."""

    def spans(self, text: str) -> Iterator[Span]:
        covered = 0
        end: re.Match[str] | None = None
        searched = -1  # END lines were searched for from here on (None found: none after it)
        for begin in self.regex.finditer(text):
            if begin.start() < covered:
                continue
            if end is None or end.start() < begin.end():
                if searched >= 0 and end is None and begin.end() >= searched:
                    found = None  # no END line after an earlier BEGIN: none after this one either
                else:
                    found = _PEM_END.search(text, begin.end())
                    searched = begin.end()
                end = found
            if end is not None and end.start() - begin.end() <= _PEM_LONGEST:
                covered = end.end()
            else:
                body = _PEM_BODY.match(text, begin.end())
                covered = body.end() if body else begin.end()
            yield begin.start(), covered


def _luhn(digits: str) -> bool:
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char) * (2 if i % 2 else 1)
        total += value - 9 if value > 9 else value
    return total % 10 == 0


def _card(candidate: str) -> bool:
    digits = re.sub(r"[ -]", "", candidate)
    return 13 <= len(digits) <= 19 and _luhn(digits)


def _credential_like(candidate: str) -> bool:
    """A word after ``Bearer``/``Basic``/``Token`` that looks like a credential, not English ("a basic example",
    "token expired"): a digit, a symbol, or upper case after its first letter."""
    return (
        any(c.isdigit() or c in "._~+/=-" for c in candidate)
        or (any(c.isupper() for c in candidate[1:]) and any(c.islower() for c in candidate))
        or len(candidate) >= 24
    )


_CREDENTIALS = re.compile(
    r"(?<![A-Za-z0-9_])(?:Bearer|Basic|Token)\s+(?P<secret>[A-Za-z0-9._~+/=-]{6,})", re.IGNORECASE
)


#: The built-in value patterns, in the order of the module docstring's table.
VALUE_PATTERNS: tuple[ValuePattern, ...] = (
    ValuePattern(
        name="url_credentials",
        # The scheme starts where a word starts (a lookbehind, not a scan from every letter); user and password
        # stop at what ends a URL's authority. The password is greedy up to the last "@" before the host.
        regex=re.compile(r"(?<![\w+.-])[A-Za-z][\w+.-]{0,30}://[^\s:/?#@]{0,256}:(?P<secret>[^\s/?#]{1,1024})@"),
        example="postgresql://app:Sup3rS3cret@db/shop",
        hints=("://",),
    ),
    ValuePattern(
        name="bearer_credentials",
        regex=_CREDENTIALS,
        example="Authorization: Bearer 9f8e7d6c5b4a",
        accept=_credential_like,
        hints=("bearer", "basic", "token"),
        folded=True,
    ),
    ValuePattern(
        name="stripe_key",
        regex=re.compile(r"(?<![A-Za-z0-9_])(?:(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{10,}|whsec_[0-9A-Za-z+/=]{16,})"),
        example="sk_live_4eC39HqLyjWDarjtT1zdp7dc",
        hints=("sk_", "rk_", "whsec_"),
    ),
    _AccessKey(
        name="aws_access_key",
        regex=_AWS_ID,
        example="AKIAIOSFODNN7EXAMPLE wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        hints=("AKIA", "ASIA"),
    ),
    ValuePattern(
        name="github_token",
        regex=re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
        example="ghp_16C7e42F292c6912E7710c838347Ae178B4a",
        hints=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    ValuePattern(
        name="slack_token",
        regex=re.compile(r"(?<![A-Za-z0-9_])xox[abposr]-[A-Za-z0-9-]{10,}"),
        example="xoxb-2048-1337-AbCdEfGhIjKlMnOp",
        hints=("xox",),
    ),
    ValuePattern(
        name="google_api_key",
        regex=re.compile(r"(?<![A-Za-z0-9_-])AIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),
        example="AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe",
        hints=("AIza",),
    ),
    ValuePattern(
        name="jwt",
        # Header and payload are base64url JSON objects (they start "eyJ", '{"'); the signature may be empty.
        regex=re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),
        example="eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl",
        hints=("eyJ",),
    ),
    _PrivateKey(
        name="private_key",
        regex=_PEM_BEGIN,
        example="-----BEGIN RSA PRIVATE KEY-----\nMIIEow...\n-----END RSA PRIVATE KEY-----",
        hints=("PRIVATE KEY-----",),
    ),
    ValuePattern(
        name="card_number",
        regex=re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])"),
        example="4111 1111 1111 1111",
        accept=_card,
        hints=tuple("0123456789"),
    ),
)


def user_patterns(regexes: Iterable[re.Pattern[str]]) -> tuple[ValuePattern, ...]:
    """The ``redact_patterns`` option's regular expressions as value patterns (named by their place)."""
    return tuple(ValuePattern(name=f"redact_patterns[{n}]", regex=r) for n, r in enumerate(regexes))


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
class Walked:
    """What a walk made of a value: JSON-ready; ``not_json`` when something was kept as its repr, ``cut`` when
    something was left out (too deep, too many values, too long)."""

    value: Any
    not_json: bool = False
    cut: bool = False


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
        return _Walk(self, whole=True).walked(value)

    def shown(self, value: Any) -> Walked:
        """``value`` as it may be shown (an alert, a log record's data, an exception's arguments): strings
        lose their secret parts only."""
        return _Walk(self, whole=False).walked(value)

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
        walk = _Walk(self, whole=True)
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


class _Walk:
    """One bounded, iterative walk (no recursion: a value nested 5,000 levels deep is cut at MAX_DEPTH)."""

    def __init__(self, redactor: Redactor, *, whole: bool) -> None:
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
