"""The value patterns of the redaction: secrets recognised by their shape wherever they are (a URL's password,
a bearer token, Stripe, AWS, GitHub, Slack and Google keys, a JWT, a PEM private key, a card number), each a
:class:`ValuePattern` (a bounded regular expression anchored on a literal or a word boundary, with hints that let
most texts skip it), and the ``redact_patterns`` option's own as patterns (:func:`user_patterns`). The table of
what each takes out is in :mod:`.redaction`'s docstring, in the order of :data:`VALUE_PATTERNS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

Span = tuple[int, int]


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
        # Not glued to letters or digits: a task id (a UUID such as ``...-a625-0996254939a4``) holds digit runs
        # that can pass the Luhn check, and its log lines were redacted in the middle of the id.
        regex=re.compile(r"(?<![\dA-Za-z-])(?:\d[ -]?){12,18}\d(?![\dA-Za-z-])"),
        example="4111 1111 1111 1111",
        accept=_card,
        hints=tuple("0123456789"),
    ),
)


def user_patterns(regexes: Iterable[re.Pattern[str]]) -> tuple[ValuePattern, ...]:
    """The ``redact_patterns`` option's regular expressions as value patterns (named by their place)."""
    return tuple(ValuePattern(name=f"redact_patterns[{n}]", regex=r) for n, r in enumerate(regexes))
