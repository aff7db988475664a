"""Guardrail options: the settings schema, its validation, and the one lookup rule.

This is the only module that reads settings. Every guardrail asks :func:`resolve` for an option, and
:func:`resolve` applies one rule everywhere:

1. the per-call option (``task.apply_async(..., tenant_required=True)``; it travels in the message header,
   so the worker sees it on every delivery and retry),
2. the task attribute (a decorator kwarg such as ``@shared_task(base=GuardedTask, tenant_required=True)``,
   or a class attribute of a ``GuardedTask`` subclass); ``None`` means "not set on this task",
3. the app config: ``app.conf.guardrails = {...}``, in Django ``CELERY_GUARDRAILS = {...}`` (Celery maps it to
   the same key when the app is configured with ``namespace="CELERY"``),
4. the documented default below.

Keys are lowercase, like Celery's own settings. An unknown key or a bad value raises
:class:`~celery_guardrails.exceptions.ConfigurationError` naming the key, when the worker starts (see
:mod:`celery_guardrails.runtime.install`), when a Django project runs its system checks, and on first use.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import import_module
from string import Formatter
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.local import Proxy

from celery_guardrails.exceptions import ConfigurationError
from celery_guardrails.foundation.redaction import DEFAULT_REDACT_KEYS

logger = logging.getLogger(__name__)

#: Names refused as arguments or keys by default (sensitive_keys): secrets and payment data.
SENSITIVE_KEYS = (
    "password",
    "passwd",
    "secret",
    "api_key",
    "apikey",
    "private_key",
    "access_token",
    "refresh_token",
    "auth_token",
    "ssn",
    "cvv",
    "cvc",
    "card_number",
    "credit_card",
)

#: Errors no retry can fix (a bug, bad input): permanent at their first failure (deterministic_errors). Also
#: Django's and pydantic's ValidationError, once their module is imported (see DETERMINISTIC_MODULES).
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    LookupError,
    NotImplementedError,
    UnicodeError,
)
#: (module, class) of validation errors that are deterministic too, checked only when their module is imported:
#: an error of a module nobody imported cannot be raised, and nothing is imported for them.
DETERMINISTIC_MODULES = (
    ("django.core.exceptions", "ValidationError"),
    ("pydantic", "ValidationError"),
    ("pydantic_core", "ValidationError"),
)

CALL = "call"
TASK = "task"
APP = "app"


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One guardrail option: where it may be set, its default and how a value is checked."""

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any]
    scopes: frozenset[str]


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be True or False, got {value!r:.80}")
    return value


def _callable_or_path(value: Any) -> Any:
    if value is None or callable(value):
        return value
    if isinstance(value, str) and "." in value:
        return value
    raise ValueError(f"must be a callable or a dotted path 'package.module.name', got {value!r:.80}")


#: Largest count an option takes: what a database integer column and a Lua number hold exactly.
COUNT_MAX = 2**31 - 1


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= COUNT_MAX:
        raise ValueError(f"must be a whole number from 1 to {COUNT_MAX}, got {value!r:.80}")
    return value


def _versions(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"must be payload versions (whole numbers of at least 1), got {value!r:.80}")
    found = tuple(_positive_int(item) for item in value)
    if not found:
        raise ValueError("must name at least one payload version")
    return found


def _bytes_or_off(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value != 0 and not 256 <= value <= COUNT_MAX):
        raise ValueError(f"must be a number of bytes of at least 256, or 0 to turn the limit off, got {value!r:.80}")
    return value


#: Default max_payload_depth: levels of lists and dicts in a task's arguments.
MAX_PAYLOAD_DEPTH = 100
#: The deepest max_payload_depth may be: well inside what pickle (prefork's hand-over to its child), the JSON
#: codecs and the record's walks take under Python's default recursion limit of 1,000.
DEPTH_CEILING = 400


def _depth(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= DEPTH_CEILING:
        raise ValueError(f"must be a whole number of levels from 1 to {DEPTH_CEILING}, got {value!r:.80}")
    return value


def _key_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValueError(f"must be a list of argument or key names, got {value!r:.80}")
    value = list(value)
    if not all(isinstance(name, str) for name in value):  # str(None) was the name "none"
        raise ValueError(f"names are strings, got {value!r:.120}")
    names = tuple(name.strip().lower().replace("-", "_") for name in value)
    if not all(re.fullmatch(r"[a-z0-9_]+", name) for name in names):
        raise ValueError(f"names are letters, digits and underscores, got {list(value)!r:.120}")
    return names


def _reason_or_none(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.strip()) < 10:
        raise ValueError(f"must say why, in a sentence (10 characters at least), got {value!r:.80}")
    return value.strip()


def _non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= COUNT_MAX:
        raise ValueError(f"must be a whole number from 0 to {COUNT_MAX}, got {value!r:.80}")
    return value


def _finite(value: Any) -> bool:
    """Whether ``value`` is a real, finite number (not a bool): NaN passes every comparison check as False, so
    ``nan <= 0`` let it through, and infinity makes every sum and sleep with it infinite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # a whole number past the largest float (10**400): as good as infinite
        return False


#: Longest duration an option takes (100 years, in seconds): a longer one overflows the date arithmetic it feeds
#: (now - dead_letter_retention before the year 1) and Redis expiries.
SECONDS_MAX = 100 * 365 * 24 * 3600.0


def _seconds(value: Any) -> float:
    if not _finite(value) or not 0 < value <= SECONDS_MAX:
        raise ValueError(f"must be a positive finite number of seconds, at most 100 years, got {value!r:.80}")
    return float(value)


def _seconds_or_off(value: Any) -> float:
    if not _finite(value) or not 0 <= value <= SECONDS_MAX:
        raise ValueError(f"must be a finite number of seconds up to 100 years, 0 to turn it off, got {value!r:.80}")
    return float(value)


def _ratio(value: Any) -> float:
    if not _finite(value) or not 0 <= value <= 10:
        raise ValueError(f"must be a number from 0 to 10 (retries per first attempt), got {value!r:.80}")
    return float(value)


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}, got {value!r:.80}")
        return str(value)

    return check


def _exception_types(value: Any) -> tuple[type[BaseException], ...]:
    items = value if isinstance(value, list | tuple) else (value,)
    types = []
    for item in items:
        try:
            loaded = load(item) if isinstance(item, str) else item
        except ConfigurationError as exc:  # named by the option's key, not the path's
            raise ValueError(exc.problem) from None
        if not (isinstance(loaded, type) and issubclass(loaded, BaseException)):
            raise ValueError(f"must be exception classes or dotted paths to them, got {item!r:.80}")
        types.append(loaded)
    return tuple(types)


def _patterns(value: Any) -> tuple[tuple[re.Pattern[str], str], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        checked = tuple((re.compile(pattern), _choice("transient", "permanent")(kind)) for pattern, kind in pairs)
    except (TypeError, ValueError, re.error) as exc:
        raise ValueError(f"must map regular expressions to 'transient' or 'permanent': {exc}") from None
    return checked


def _key_spec(value: Any) -> Any:
    if callable(value) or (isinstance(value, str) and value.strip()):
        return value
    # Not echoed: a key given per call is a value (it may hold anything the caller put in it).
    raise ValueError(f"must be a str.format template, a key, or a callable, got {_kind(value)}")


def _kind(value: Any) -> str:
    """What a refused value is, without what it holds: for values that may be secrets."""
    if isinstance(value, str | bytes):
        return f"{'an empty ' if not value else 'a '}{type(value).__name__}" + (" of spaces" if value.isspace() else "")
    return "None" if value is None else f"a {type(value).__name__}"


#: A team, person or provider name (owner, owners' values, dependency, a schedule's owner).
NAME = re.compile(r"[\w.:-]{1,100}")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"must be a name of 1 to 100 letters, digits or . : - _, got {value!r:.80}")
    return value


def masked(url: str) -> str:
    """``url`` with its credentials replaced by ``***``: the user info of every address (a cluster URL has
    several) and the value of every query parameter whose name says password, secret, token or key. What a
    validator may show of a URL."""
    url = re.sub(r"//[^/@?#]*@", "//***@", url)
    return re.sub(r"([?&][^=&#]*(?:pass|secret|token|key|auth)[^=&#]*=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)


def _redis_url(value: str) -> str:
    """``value`` if the store can connect with it; the errors show it masked (it may hold a password)."""
    from celery_guardrails.stores.redis_client import check_url

    try:
        check_url(masked(value))  # the same shape with the secrets out: what is wrong is said the same way
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return value


def _store(value: Any) -> str:
    from celery_guardrails.stores.redis_client import SCHEMES

    if value == "django" or (isinstance(value, str) and value.startswith(SCHEMES)):
        return value if value == "django" else _redis_url(value)
    shown = f"{masked(value)!r:.80}" if isinstance(value, str) else _kind(value)
    raise ValueError(f"must be 'django' or a Redis URL such as 'redis://127.0.0.1:6379/1', got {shown}")


def _owners(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map task-name patterns to owner names, got {value!r:.80}")
    for pattern, owner in value.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ValueError(f"task-name patterns are non-empty strings, got {pattern!r:.80}")
        try:  # the rule of the task-level owner: one rule for every owner name
            _name(owner)
        except ValueError as exc:
            raise ValueError(f"pattern {pattern!r:.80}: the owner {exc}") from None
    return dict(value)


def _sinks(value: Any) -> list[str] | None:
    if value is None:
        return None
    from celery_guardrails.stores.redis_client import SCHEMES

    names = [value] if isinstance(value, str) else value
    if isinstance(names, Mapping) or not isinstance(names, list | tuple):
        raise ValueError(f"must be a list of sinks ('django', 'redis' or Redis URLs), got {_kind(value)}")
    if not names:  # no sink: a final failure would be acked with nothing recorded
        raise ValueError("must name at least one sink: with none, a final failure would be recorded nowhere")
    for number, name in enumerate(names, start=1):
        if name in ("django", "redis"):
            continue
        if not isinstance(name, str) or not name.startswith(SCHEMES):
            shown = f"{masked(name)!r:.80}" if isinstance(name, str) else _kind(name)
            raise ValueError(f"sink {number}: sinks are 'django', 'redis' or Redis URLs, got {shown}")
        try:
            _redis_url(name)
        except ValueError as exc:
            raise ValueError(f"sink {number}: {exc}") from None
    return list(names)


def _fernet_keys(value: Any) -> tuple[str, ...]:
    import base64
    import binascii

    # Never echo a key, nor any part of a value that may hold one: messages name the place only.
    keys = [value] if isinstance(value, str | bytes) else value
    if not isinstance(keys, list | tuple):  # a set has no first key to seal with; a dict is not a list
        raise ValueError(
            f"must be a list of Fernet keys (the first seals, every one opens), got {_kind(value)} (not shown)"
        )
    checked = []
    for number, key in enumerate(keys, start=1):
        try:  # bytes, as Fernet.generate_key() returns them, are the same key: kept as text
            text = key.decode("ascii") if isinstance(key, bytes) else key
            valid = isinstance(text, str) and len(base64.urlsafe_b64decode(text.encode("ascii"))) == 32
        except (binascii.Error, ValueError):
            valid = False
        if not valid:
            raise ValueError(
                f"key {number} is not a Fernet key (32 url-safe base64-encoded bytes; make one with "
                "cryptography.fernet.Fernet.generate_key()); the key is not shown"
            )
        checked.append(text)
    return tuple(checked)


#: A header name is an RFC 9110 token.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_names(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else None
    if items is None or not all(isinstance(v, str) and _TOKEN.fullmatch(v) for v in items):
        raise ValueError(f"must be a list of HTTP header names, got {value!r:.80}")
    return tuple(items)


def _redact_keys(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple | set | frozenset) else None
    if items is None:
        raise ValueError(f"must be a list of key-name fragments (matched anywhere in a name), got {value!r:.80}")
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"fragments are non-empty strings, got {item!r:.80}")
    return tuple(items)


#: The alert channels there are (celery_guardrails.operations.alerts.send handles each).
ALERT_CHANNELS = ("log", "mail", "webhook")


def _channels(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else None
    if items is None:
        raise ValueError(f"must be a list of channels (known: {', '.join(ALERT_CHANNELS)}), got {value!r:.80}")
    for item in items:
        if item not in ALERT_CHANNELS:
            raise ValueError(f"unknown channel {item!r:.80}; known: {', '.join(ALERT_CHANNELS)}")
    return tuple(items)


def _webhooks(value: Any) -> tuple[str, ...]:
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list | tuple):
        raise ValueError(f"must be a list of http:// or https:// URLs, got {_kind(value)}")
    for number, url in enumerate(urls, start=1):
        # Not shown: a webhook URL is often its own secret (a Slack or Teams URL is the credential).
        if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/?#]+[^\s]*", url):
            raise ValueError(f"webhook {number} is not an http:// or https:// URL (not shown: it may hold a secret)")
    return tuple(urls)


def _owner_emails(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map owner names to lists of mail addresses, got {_kind(value)}")
    checked = {}
    for owner, addresses in value.items():
        try:
            _name(owner)
        except ValueError as exc:
            raise ValueError(f"the owner {exc}") from None
        items = [addresses] if isinstance(addresses, str) else addresses  # one address (a str was spelled out)
        if not isinstance(items, list | tuple) or not all(
            isinstance(a, str) and re.fullmatch(r"[^@\s]+@[^@\s]+", a) for a in items
        ):
            raise ValueError(f"owner {owner!r}: must be a mail address or a list of them")
        checked[owner] = tuple(items)
    return checked


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


#: Default histogram buckets in seconds: 5 ms to 5 minutes (task runs and queue waits alike).
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"must be a TCP port from 1 to 65535, got {value!r:.80}")
    return value


def _buckets(value: Any) -> tuple[float, ...]:
    items = tuple(value) if isinstance(value, list | tuple) else ()
    if not items or any(
        isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf") for v in items
    ):
        raise ValueError(f"must be a list of positive finite numbers of seconds, got {value!r:.80}")
    if any(a >= b for a, b in itertools.pairwise(items)):
        raise ValueError(f"must be increasing, got {value!r:.80}")
    return tuple(float(v) for v in items)


def _token(value: Any) -> str:
    if not isinstance(value, str) or len(value) < 16 or value != value.strip():
        raise ValueError("must be a string of at least 16 characters, no spaces around it")  # never echo a secret
    return value


def _admin_tenants(value: Any) -> Any:
    if value is None or value == "permissions" or callable(value) or (isinstance(value, str) and "." in value):
        return value
    raise ValueError(
        "must be a callable from a user to the tenants they may see, a dotted path 'package.module.name' to one, "
        f"or 'permissions' (a Django permission per tenant), got {value!r:.80}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulePolicy:
    """The guardrails of one beat entry (``schedules["<entry name>"]``); defaults documented here.

    An entry with no policy is watched with these defaults (:data:`DEFAULT_POLICY`: ``default`` True); a policy of
    ``None`` (``schedules = {"cleanup": None}``) opts the entry out, leaving it to Celery as it is.
    """

    #: IANA zone the entry's crontab is read in; None: the crontab's own zone, else the app's ``timezone``
    #: (a crontab entry without one gets a start-up warning that names it).
    timezone: ZoneInfo | None = None
    #: A period due while the previous run still goes: "skip" it (recorded skipped_overlap), "queue" it
    #: (it waits, through RetryLater), or "allow" both to run.
    overlap: str = "skip"
    #: Periods beat missed (down longer than grace): "skip" (record them missed, run none), "latest" (run
    #: the most recent once, as Celery beat does), or "all" (run each, oldest first, the newest
    #: catch_up_limit of them).
    catch_up: str = "latest"
    catch_up_limit: int = 10
    #: Seconds a run may start late before its period counts as missed; None (not set): 60 s, or half the
    #: entry's period when that is shorter (an every-4-s entry is missed 2 s late): see :meth:`grace_for`.
    grace: float | None = None
    #: Seconds a started run may take before it counts as overdue (None: never).
    max_runtime: float | None = None
    #: Give the task the end of the last successful period (``self.request.since``, and ``since=`` when
    #: the task takes that argument).
    since: bool = False
    #: A fixed local time that happens twice (fall back) runs at the "first" occurrence, or at "both".
    fall_back: str = "first"
    #: Who hears of missed and overdue runs (else the task's owner).
    owner: str | None = None
    #: The tenant every run of the entry runs as, unless the entry names its own (a beat_schedule entry's
    #: ``options={"tenant": ...}``, a django-celery-beat row's headers ``{"tenant": ...}``).
    tenant: str | None = None
    #: True for the policy of an entry the ``schedules`` setting does not name (shown as "default").
    default: bool = False

    def grace_for(self, period: float | None) -> float:
        """The grace in seconds of an entry whose period (seconds between runs; None: not known) is ``period``:
        the policy's own, else :data:`DEFAULT_GRACE` capped at half the period."""
        if self.grace is not None:
            return self.grace
        return DEFAULT_GRACE if period is None else min(DEFAULT_GRACE, period / 2)


#: Seconds of grace of a policy that sets none, at most (half the entry's period when that is shorter).
DEFAULT_GRACE = 60.0
#: The policy of a beat entry the ``schedules`` setting does not name: watched, with every default.
DEFAULT_POLICY = SchedulePolicy(default=True)


def _zone(value: Any) -> ZoneInfo | None:
    if value is None:
        return None
    try:
        return ZoneInfo(str(value))
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r:.80} (an IANA name such as 'Europe/Berlin')") from None


_POLICY_CHECKS: Mapping[str, Callable[[Any], Any]] = {
    "timezone": _zone,
    "overlap": _choice("skip", "queue", "allow"),
    "catch_up": _choice("skip", "latest", "all"),
    "catch_up_limit": _positive_int,
    "grace": _seconds,
    "max_runtime": lambda value: None if value is None else _seconds(value),
    "since": _boolean,
    "fall_back": _choice("first", "both"),
    "owner": _name,
    "tenant": lambda value: None if value is None else _tenant(value),
}


def _tenant(value: Any) -> str:
    from celery_guardrails.foundation.context import validate_tenant  # context reads no settings; no cycle at import

    return validate_tenant(value)


def _schedules(value: Any) -> dict[str, SchedulePolicy | None]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must map beat entry names to policy dicts (or None to opt out), got {value!r:.80}")
    policies: dict[str, SchedulePolicy | None] = {}
    for entry, raw in value.items():
        if not isinstance(entry, str) or not entry or len(entry) > 200:
            raise ValueError(f"entry names are strings of 1 to 200 characters, got {entry!r:.80}")
        if raw is None:  # opted out: not watched, left to Celery as it is
            policies[entry] = None
            continue
        if not isinstance(raw, Mapping):
            raise ValueError(f"entry {entry!r}: the policy must be a dict (or None to opt out), got {raw!r:.80}")
        checked = {}
        for key, item in raw.items():
            if key not in _POLICY_CHECKS:
                close = difflib.get_close_matches(str(key), list(_POLICY_CHECKS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(_POLICY_CHECKS)}"
                raise ValueError(f"entry {entry!r}: unknown policy key {key!r}{hint}")
            try:
                checked[key] = _POLICY_CHECKS[key](item)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"entry {entry!r}, {key}: {exc}") from None
        policies[entry] = SchedulePolicy(**checked)
    return policies


OPTIONS: Mapping[str, Option] = {
    option.name: option
    for option in (
        Option(
            name="tenant_required",
            default=False,
            doc="Refuse to publish or run the task without a tenant.",
            check=_boolean,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="tenant_activator",
            default=None,
            doc="Callable (or dotted path) taking a tenant id and returning a context manager entered "
            "around the task body, e.g. to switch a django-tenants schema. Not called without a tenant.",
            check=_callable_or_path,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="tenant_resolver",
            default=None,
            doc="Django: callable (or dotted path) taking the HttpRequest and returning its tenant id or None.",
            check=_callable_or_path,
            scopes=frozenset({APP}),
        ),
        Option(
            name="idempotent",
            default=False,
            doc="Declare the task safe to run twice: any transient or unknown error is then retried, whatever "
            "the body did before it (see celery_guardrails.runtime.gate).",
            check=_boolean,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_unsafe",
            default=False,
            doc="Let a task that is not idempotent be retried on ambiguous failures too (a read timeout, a 5xx, "
            "an error after an effect): it may then act twice. The audit scores it 0; warned about at start-up.",
            check=_boolean,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="marks_effects",
            default=None,
            doc="Whether the body marks its effects with effect() (then a failure before the first one is "
            "retried); None: told from the task function's own code. Set True when the blocks are in code the "
            "body calls from another module.",
            check=_boolean,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="idempotency_key",
            default=None,
            doc="str.format template over the task's bound arguments ('charge:{order_id}'), or a callable "
            "taking the task's arguments; per call, the key itself. Scoped by task name and tenant.",
            check=_key_spec,
            scopes=frozenset({CALL, TASK}),
        ),
        Option(
            name="idempotency_lease",
            default=60.0,
            doc="Seconds a claim lives without a heartbeat; a running task renews it every third of it. A "
            "delivery whose worker died is taken over this long after its last heartbeat.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="idempotency_retention",
            default=7 * 24 * 3600.0,
            doc="Seconds a completed or failed key is kept (7 days): duplicates within it are skipped.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="atomic",
            default=False,
            doc="Django store: run the body in transaction.atomic() and commit the completion mark in the "
            "same transaction as the effect (exactly once for database effects).",
            check=_boolean,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="dedupe_on_publish",
            default=False,
            doc="An optimisation, not the guarantee: do not publish a message whose key was published within "
            "dedupe_ttl; return the first one's AsyncResult instead.",
            check=_boolean,
            scopes=frozenset({CALL, TASK}),
        ),
        Option(
            name="dedupe_ttl",
            default=3600.0,
            doc="Seconds dedupe_on_publish remembers a published key.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="ordering_key",
            default=None,
            doc="Opt-in ordering per key: str.format template over the task's bound arguments ('account:{id}'), "
            "or a callable taking the task's arguments; per call, the key itself. Scoped by task name and tenant. "
            "Messages of one key run in the order they were published; different keys are not ordered.",
            check=_key_spec,
            scopes=frozenset({CALL, TASK}),
        ),
        Option(
            name="ordering_gap_timeout",
            default=3600.0,
            doc="Seconds the messages of an ordering key wait for a missing earlier one (lost before it was "
            "published, or gone where it could not say so) before the key moves past it; one that turns up later "
            "is dead-lettered (ordering_gap). Keep it above the longest run plus retries of one message.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="ordering_gap_alert_after",
            default=300.0,
            doc="Seconds an ordering key may wait for a missing earlier message before its owner is alerted (once "
            "per wait, then throttled like dead letters): time to find the message before ordering_gap_timeout "
            "gives it up. 0: no alert.",
            check=_seconds_or_off,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="ordering_wait_max",
            default=30.0,
            doc="Seconds a message waiting for an earlier one of its key stays away at most: its looks back start "
            "at retry_later_delay and double while the key does not move. Also how late the key may resume once "
            "a long wait ends.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="ordering_retention",
            default=30 * 24 * 3600.0,
            doc="Seconds an ordering key's counters are kept after its last message was published or done (30 "
            "days); a key idle for longer starts again at 1.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="max_attempts",
            default=5,
            doc="Runs at most, the first one included, however the retries come (classified failures, "
            "autoretry_for, self.retry()). Unset on a task that sets Celery's max_retries (or retry_kwargs="
            "{'max_retries': n}): that plus one.",
            check=_positive_int,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="transient_errors",
            default=(),
            doc="Exception classes (or dotted paths) retried with backoff, where the retry gate finds a re-run "
            "safe. Celery's autoretry_for (less dont_autoretry_for) on a GuardedTask counts as these.",
            check=_exception_types,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="permanent_errors",
            default=(),
            doc="Exception classes (or dotted paths) never retried; checked before transient_errors.",
            check=_exception_types,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="deterministic_errors",
            default=DETERMINISTIC_ERRORS,
            doc="Exception classes (or dotted paths) no retry can fix: permanent at their first failure, even "
            "when a broader transient_errors or autoretry_for class (Exception) matches; a class of "
            "transient_errors at least as specific wins. Default: ValueError, TypeError, KeyError, "
            "AttributeError, LookupError, NotImplementedError, UnicodeError, and Django's and pydantic's "
            "ValidationError; () turns it off.",
            check=_exception_types,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="error_patterns",
            default=(),
            doc="Ordered {regex: 'transient'|'permanent'} matched against the error message, for errors "
            "that crossed an RPC boundary as text.",
            check=_patterns,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="unknown_errors",
            default="auto",
            doc="'auto': an unclassified error is transient, retried only where the retry gate finds a re-run "
            "safe (celery_guardrails.runtime.gate); or 'transient' / 'permanent' for all tasks (the gate still applies "
            "to 'transient').",
            check=_choice("auto", "transient", "permanent"),
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="backoff",
            default="equal_jitter",
            doc="After the n-th failed attempt, 'equal_jitter': half fixed, half random of min(backoff_max, "
            "backoff_base * 2**n), so the first retry waits backoff_base to twice that (1-2 s, then 2-4 s, 4-8 s, "
            "...); 'full_jitter': random(0, min(backoff_max, backoff_base * 2**(n-1))), which may retry at once; "
            "'decorrelated_jitter': min(backoff_max, random(backoff_base, 3 * previous delay)).",
            check=_choice("equal_jitter", "full_jitter", "decorrelated_jitter"),
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="backoff_base",
            default=1.0,
            doc="Seconds: the scale of the first retry delay (with equal_jitter, its floor: the first retry "
            "waits backoff_base to twice that). Unset on a task with Celery's retry_backoff: that (True: 1).",
            check=_seconds,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="backoff_max",
            default=600.0,
            doc="Seconds: no retry delay (Retry-After included) is longer. Keep it below the Redis "
            "visibility_timeout (1 hour by default). Unset on a task with Celery's retry_backoff_max: that.",
            check=_seconds,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="backoff_random",
            default=None,
            doc="Callable (or dotted path) returning a float in [0, 1); default random.random. Inject a "
            "seeded one to test exact delays.",
            check=_callable_or_path,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_later_delay",
            default=5.0,
            doc="Seconds before a RetryLater without its own delay is delivered again.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_later_max",
            default=10,
            doc="RetryLater deliveries at most; one more is a final failure (retry_later_exhausted).",
            check=_positive_int,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="dependency",
            default=None,
            doc="Name of the provider the task depends on: tasks sharing it share a retry budget and a "
            "circuit breaker across all workers.",
            check=_name,
            scopes=frozenset({CALL, TASK}),
        ),
        Option(
            name="retry_budget_ratio",
            default=0.2,
            doc="Retries allowed per first attempt of the dependency within the sliding window.",
            check=_ratio,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_budget_floor",
            default=3,
            doc="Retries always allowed per window, whatever the first attempts.",
            check=_non_negative_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_budget_window",
            default=60.0,
            doc="Seconds: the sliding window of the retry budget.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_budget_policy",
            default="defer",
            doc="When the budget is spent: 'defer' the retry to the next window (retry_budget_max_deferrals "
            "times at most) or 'fail' it finally (retry_budget_exhausted).",
            check=_choice("defer", "fail"),
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="retry_budget_max_deferrals",
            default=10,
            doc="Budget or circuit deferrals of one message at most; one more is a final failure "
            "(retry_budget_exhausted).",
            check=_positive_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="circuit_threshold",
            default=5,
            doc="Consecutive transient failures of a dependency that open its circuit (0: no breaker).",
            check=_non_negative_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="circuit_open_seconds",
            default=30.0,
            doc="Seconds an open circuit delays new first attempts before letting probes through.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="circuit_half_open_probes",
            default=1,
            doc="First attempts let through while the circuit is half-open.",
            check=_positive_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="circuit_probe_timeout",
            default=60.0,
            doc="Seconds a half-open probe may run without reporting (its worker killed) before another is let "
            "through.",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="concurrency_key",
            default=None,
            doc="Tasks whose key renders the same share concurrency_limit slots across all workers: a str.format "
            "template over the task's bound arguments and {tenant} (the message's tenant), e.g. 'tenant:{tenant}' "
            "or a dependency name, or a callable taking the task's arguments. Not scoped by task name.",
            check=_key_spec,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="concurrency_limit",
            default=None,
            doc="Deliveries of one concurrency_key that may run at once, across all workers (required with it). A "
            "delivery that finds them all taken comes back later (RetryLater), no attempt spent.",
            check=_positive_int,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="exclusive_key",
            default=None,
            doc="Like concurrency_key with a limit of one: two tasks acting on one entity ('invoice:{invoice_id}') "
            "never run at once. Both may be set on one task (two slots, the concurrency slot taken first).",
            check=_key_spec,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="concurrency_reap_after",
            default=300.0,
            doc="Seconds without a heartbeat after which a slot's holder is reaped (its worker died, or stalled): "
            "recorded as failed with reason 'lost', holder_reaped sent. A running holder beats every quarter of it "
            "(at most every 10 s). Reaping runs in every capacity check and on the watchdog's timer. A stalled "
            "holder that resumes is fenced at its next boundary (SlotLostError, holder_fenced).",
            check=_seconds,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="concurrency_max_waits",
            default=100,
            doc="Waits for a slot that spend neither an attempt nor retry_later_max; past them each further wait "
            "counts toward retry_later_max (then a final failure retry_later_exhausted).",
            check=_positive_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="store_timeout",
            default=5.0,
            doc="Seconds a Redis store connection may take to connect or answer before the store counts as "
            "unavailable (a half-open connection would stall heartbeats). For the Django store, set the "
            "database's own connect and statement timeouts.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="store",
            default=None,
            doc="Where budgets and circuit states live: 'django' (the Django app's tables) or a Redis URL: one "
            "server (redis://, rediss://, unix://), a Redis Cluster (redis+cluster://host:7000) or Sentinel "
            "(sentinel://host:26379/1?master_name=mymaster). Default: 'django' when the Django app is "
            "installed, else the broker's Redis (a sentinel:// broker with its master_name transport option).",
            check=_store,
            scopes=frozenset({APP}),
        ),
        Option(
            name="owner",
            default=None,
            doc="Who owns the task's dead letters and is alerted about them (a team or person name).",
            check=_name,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="owners",
            default={},
            doc="App-wide owners by task-name pattern: {'payments.*': 'payments'} (fnmatch, first match).",
            check=_owners,
            scopes=frozenset({APP}),
        ),
        Option(
            name="dead_letter_sinks",
            default=None,
            doc="Where dead letters are recorded: 'django', 'redis' (the store's Redis stream) or Redis URLs. "
            "Default: ['django'] with the Django app, else ['redis'].",
            check=_sinks,
            scopes=frozenset({APP}),
        ),
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
        Option(
            name="redact_results",
            default=True,
            doc="The result backend stores a guarded task's failure redacted: the exception (its type, with its "
            "arguments and plain attributes redacted; other attributes dropped) and the traceback text. False: "
            "Celery stores them as raised.",
            check=_boolean,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="seal_keys",
            default=(),
            doc="Fernet keys that seal the original arguments and header of each dead letter for replay (the "
            "record itself shows them redacted). The first seals, every one opens: to rotate, put a new key first, "
            "run `manage.py guardrails_deadletters reseal`, then drop the old one. Empty: no sealed copies, and a "
            "record with redacted arguments cannot be replayed. Needs the cryptography package.",
            check=_fernet_keys,
            scopes=frozenset({APP}),
        ),
        Option(
            name="alert_channels",
            default=("log", "mail"),
            doc="How owners hear of dead letters: 'log', 'mail' (Django), 'webhook' (alert_webhooks); another "
            "name is an error.",
            check=_channels,
            scopes=frozenset({APP}),
        ),
        Option(
            name="alert_webhooks",
            default=(),
            doc="http:// or https:// URLs that receive each alert as a JSON POST (an error never shows them).",
            check=_webhooks,
            scopes=frozenset({APP}),
        ),
        Option(
            name="alert_timeout",
            default=5.0,
            doc="Seconds a webhook may take.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="alert_throttle",
            default=300.0,
            doc="Seconds of a throttle window per (owner, task, reason): one alert, then one summary. Also how "
            "long a process leaves an unreachable alert channel alone after its one warning line.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="run_alert_throttle",
            default=300.0,
            doc="Seconds: missed and overdue runs of one schedule alert its owner once, then are counted while "
            "they go on (each pushes the window's end this far, up to 12 windows after the alert) and summed up in "
            "one summary when they stop. 0: an alert for every period.",
            check=_seconds_or_off,
            scopes=frozenset({APP}),
        ),
        Option(
            name="owner_emails",
            default={},
            doc="Mail addresses per owner: {'payments': ['pay-oncall@example.com']} (else ADMINS).",
            check=_owner_emails,
            scopes=frozenset({APP}),
        ),
        Option(
            name="dead_letter_retention",
            default=90 * 24 * 3600.0,
            doc="Seconds a discarded or resolved dead letter is kept (90 days); open ones are never pruned.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="payload_version",
            default=1,
            doc="The version of the payload shape this task's publishers send (the header field pv). Raise it when "
            "the arguments change shape; workers that do not accept it dead-letter the message "
            "(unknown_payload_version) instead of running it wrongly.",
            check=_positive_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="accepts_versions",
            default=None,
            doc="The payload versions this task's workers run (a message without pv is version 1). None: only "
            "payload_version. During a rollout, a new worker accepts (1, 2) while old publishers still send 1.",
            check=_versions,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="max_payload_bytes",
            default=65536,
            doc="Largest serialised arguments a publish may send; larger is refused at publish "
            "(PayloadTooLargeError, naming the size): send a storage reference instead. 0: no limit.",
            check=_bytes_or_off,
            scopes=frozenset({CALL, TASK, APP}),
        ),
        Option(
            name="max_payload_depth",
            default=MAX_PAYLOAD_DEPTH,
            doc="Deepest nesting of lists and dicts the arguments may have (an argument that is a list of numbers "
            "is 1 level): deeper is refused at publish (PayloadTooDeepError) and, from another producer, "
            "dead-lettered malformed_message on delivery, never run. At most 400: a prefork worker hands the "
            "arguments to its child with pickle, which fails several hundred levels down.",
            check=_depth,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="sensitive_keys",
            default=SENSITIVE_KEYS,
            doc="Argument names and dict keys (at any depth) refused at publish as secrets or personal data "
            "(SensitivePayloadError): a name matches when its words (split at _) contain the entry's words. Add "
            "your own (email, phone, date_of_birth).",
            check=_key_names,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="allow_sensitive_payload",
            default=None,
            doc="A task that must carry a sensitive value says why here (a sentence); the guard then lets it "
            "through, and guardrails_audit lists the task and the reason.",
            check=_reason_or_none,
            scopes=frozenset({TASK}),
        ),
        Option(
            name="max_deliveries",
            default=3,
            doc="Redeliveries of a message that started and never finished (its worker died) before it is "
            "dead-lettered as poison instead of run again.",
            check=_positive_int,
            scopes=frozenset({TASK, APP}),
        ),
        Option(
            name="schedules",
            default={},
            doc="Policies of beat entries (CELERY_BEAT_SCHEDULE names or django-celery-beat PeriodicTask "
            "names): {'nightly-report': {'timezone': 'Europe/Berlin', 'overlap': 'skip', 'catch_up': "
            "'latest', 'grace': 300, 'max_runtime': 3600}}. See SchedulePolicy for every key. An entry it does "
            "not name is watched with the default policy (grace: 60 s or half its period); None opts one out "
            "({'cleanup': None}).",
            check=_schedules,
            scopes=frozenset({APP}),
        ),
        Option(
            name="watchdog",
            default=True,
            doc="Workers check the scheduled runs against the ledger (one worker at a time, see "
            "watchdog_interval); turn off when a cron job or Kubernetes CronJob runs guardrails_watchdog.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="watchdog_interval",
            default=30.0,
            doc="Seconds between two watchdog checks in the cluster (a run is reported missed at most "
            "grace plus this late).",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="clock",
            default=None,
            doc="Callable (or dotted path) returning the current time as epoch seconds, read by the schedule "
            "guardrails (beat, ledger, watchdog), retry budgets and circuit breakers, and alert throttles; leases "
            "stay in real time. Default time.time. For demos, simulations and tests: see "
            "celery_guardrails.foundation.clock.",
            check=_callable_or_path,
            scopes=frozenset({APP}),
        ),
        Option(
            name="broker_restart_guard",
            default=True,
            doc="Redis broker, Celery 5.7: a worker outlives a restart of the broker's Redis (else it stops with "
            "\"'NoneType' object has no attribute 'hostname'\"), and the messages it had prefetched are given "
            "back to their queues as it reconnects, not after the visibility_timeout. False: Celery's own "
            "behaviour. See celery_guardrails.broker.restart_guard.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="broker_atomic_pop",
            default=True,
            doc="Redis broker (redis:// URL, no broker_transport set): the worker takes a message and records it "
            "as handed out in one step on the server, so a worker killed in between cannot lose it (kombu's BRPOP "
            "does it in two: celery/kombu#305). False: kombu's pop. See celery_guardrails.broker.atomic_pop.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="broker_lease",
            default=True,
            doc="Redis broker: while a worker holds a delivery (running, prefetched, or waiting for its ETA), a "
            "thread pushes its entry in kombu's unacked index forward, so a task longer than the visibility_timeout "
            "is not delivered again while it runs, and is redelivered the visibility_timeout (plus one kombu "
            "restore period) after its worker died. False: kombu's fixed visibility_timeout. See "
            "celery_guardrails.broker.lease.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="broker_lease_interval",
            default=None,
            doc="Seconds between two extensions of the held deliveries; None: a third of the broker's "
            "visibility_timeout. Set it below a third of the shortest visibility_timeout of the apps sharing the "
            "broker's Redis (the shortest one restores for all: celery/celery#5935).",
            check=lambda value: None if value is None else _seconds(value),
            scopes=frozenset({APP}),
        ),
        Option(
            name="rabbitmq_consumer_timeout",
            default=1800.0,
            doc="RabbitMQ broker: the server's consumer_timeout in seconds (RabbitMQ's default is 30 minutes; "
            "it cannot be read over AMQP). A worker warns at start-up about each guarded task whose time_limit is "
            "unset or longer than it (or than a task queue's x-consumer-timeout argument).",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="metrics",
            default=False,
            doc="Record Prometheus metrics (task durations, outcomes, queue wait, published and completed "
            "messages; see celery_guardrails.operations.metrics) in workers and publishers."
            " Needs prometheus-client (the "
            "prometheus extra). False: nothing is recorded. A recording failure is logged, never the task's.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="metrics_port",
            default=None,
            doc="TCP port of the worker's HTTP metrics endpoint (all addresses), served by the main process only "
            "with every pool child's metrics summed when PROMETHEUS_MULTIPROC_DIR is set. None: no endpoint.",
            check=lambda value: None if value is None else _port(value),
            scopes=frozenset({APP}),
        ),
        Option(
            name="metrics_buckets",
            default=DEFAULT_BUCKETS,
            doc="Upper bounds in seconds of the duration and queue-wait histogram buckets, increasing (+Inf is "
            "added). Read once per process, when the first metric is recorded.",
            check=_buckets,
            scopes=frozenset({APP}),
        ),
        Option(
            name="metrics_token",
            default=None,
            doc="Django: a bearer token that may read the metrics view (Authorization: Bearer <token>) besides "
            "staff users; None: staff only.",
            check=lambda value: None if value is None else _token(value),
            scopes=frozenset({APP}),
        ),
        Option(
            name="admin_tenants",
            default=None,
            doc="Django admin: which dead letters, ledger records and figures a user sees. A callable (or dotted "
            "path) user -> iterable of tenant ids, or ALL_TENANTS (django_celery_guardrails.scoping); or "
            "'permissions': a permission guardrails.view_tenant_<tenant> per tenant, guardrails.view_all_tenants "
            "for every one. A user the callable fails for sees nothing. None: every user sees every tenant.",
            check=_admin_tenants,
            scopes=frozenset({APP}),
        ),
        Option(
            name="activity",
            default=True,
            doc="Keep the last day of activity in the store: delivery outcomes per task, queue and minute (each "
            "worker process adds its counts every activity_flush_interval) and each queue's depth and oldest age "
            "once a minute (read by one worker's watchdog thread). The admin dashboard charts it and the status "
            "command's rates come from it. False: nothing is kept. See celery_guardrails.operations.activity.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="activity_flush_interval",
            default=30.0,
            doc="Seconds between two additions of a worker process's outcome counts to the store (and at its "
            "exit). A process SIGKILLed loses at most this long of its counts.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="activity_retention",
            default=2 * 24 * 3600.0,
            doc="Seconds the activity is kept (Redis: expiry; Django: guardrails_prune). The charts show 24 hours.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="outbox_relay",
            default=True,
            doc="Django: each worker runs the transactional outbox's relay in a thread, publishing the messages "
            "enqueued with enqueue_in_transaction / outbox=True once their transaction committed. False: run "
            "manage.py guardrails_outbox_relay instead.",
            check=_boolean,
            scopes=frozenset({APP}),
        ),
        Option(
            name="outbox_relay_interval",
            default=1.0,
            doc="Seconds between two relay passes when the outbox is empty (a full batch is followed by the next "
            "at once): the relay's lag when idle.",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="outbox_relay_lease",
            default=60.0,
            doc="Seconds a relay's claimed outbox messages stay hidden from other relays while it publishes them; "
            "a relay that dies mid-batch leaves them to be published again after this (at least once).",
            check=_seconds,
            scopes=frozenset({APP}),
        ),
        Option(
            name="outbox_batch",
            default=100,
            doc="Outbox messages a relay pass claims and publishes at most.",
            check=_positive_int,
            scopes=frozenset({APP}),
        ),
        Option(
            name="outbox_max_attempts",
            default=12,
            doc="Publishes of one outbox message that may fail (an unknown task, a refused publish, arguments "
            "that do not encode) before it becomes a dead letter unpublishable, removed with the record's "
            "transaction. The waits between them double from 1 s to 5 minutes: 12 spans about 18 minutes, longer "
            "than a rolling deployment in which an older worker's relay may not know a new task yet. A broker "
            "that cannot be reached spends none.",
            check=_positive_int,
            scopes=frozenset({APP}),
        ),
        Option(
            name="request_id_headers",
            default=("X-Request-ID", "X-Correlation-ID"),
            doc="Django: request headers read, in order, for the correlation id of a request.",
            check=_header_names,
            scopes=frozenset({APP}),
        ),
    )
}


def _unknown(key: str, known: Any) -> ConfigurationError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigurationError(key, "unknown key" + hint)


def _checked(key: str, value: Any) -> Any:
    try:
        return OPTIONS[key].check(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(key, str(exc)) from None


def validate(raw: Any, *, scope: str = APP) -> dict[str, Any]:
    """Check a mapping of options for ``scope``; return the checked values (unset keys are absent)."""
    if not raw:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigurationError("guardrails", f"must be a dict, got {type(raw).__name__}")
    known = [name for name, option in OPTIONS.items() if scope in option.scopes]
    checked = {}
    for key, value in raw.items():
        if key not in known:
            if key in OPTIONS:
                raise ConfigurationError(key, f"cannot be set in {scope} scope")
            raise _unknown(str(key), known)
        checked[key] = _checked(key, value)
    return checked


_snapshot: ContextVar[tuple[Any, dict[str, Any]] | None] = ContextVar("guardrails_settings", default=None)


class settings_snapshot:  # lower case: used like the function it replaced, ``with settings_snapshot(app):``
    """Read the app config once for a block: a publish, a task run, a hook (Celery's config lookups are
    slow enough to show in the per-task cost when every option is looked up again). A class rather than a
    generator: it is entered several times per task."""

    __slots__ = ("app", "token")

    def __init__(self, app: Any) -> None:
        self.app = app

    def __enter__(self) -> None:
        self.token = _snapshot.set((self.app, app_settings(self.app, fresh=True)))

    def __exit__(self, *exc_info: object) -> None:
        _snapshot.reset(self.token)


def app_settings(app: Any, *, fresh: bool = False) -> dict[str, Any]:
    """The validated ``guardrails`` mapping of a Celery app (cached until the mapping is replaced)."""
    snapshot = None if fresh else _snapshot.get()
    if snapshot is not None and snapshot[0] is app:
        return snapshot[1]
    raw = app.conf.get("guardrails")
    cached = getattr(app, "_guardrails_settings", None)
    if cached is not None and cached[0] is raw:
        return cached[1]  # type: ignore[no-any-return]
    checked = validate(raw)
    app._guardrails_settings = (raw, checked)
    return checked


def django_settings() -> dict[str, Any]:
    """The validated ``CELERY_GUARDRAILS`` of the Django settings (Django imported only when called)."""
    from django.conf import settings

    return validate(getattr(settings, "CELERY_GUARDRAILS", None))


def validate_task(task: Any) -> None:
    """Check the guardrail options set as attributes of a task class; raise naming task and key. A key template
    that names a sensitive argument is refused too (:func:`check_key_templates`)."""
    for name, option in OPTIONS.items():
        value = task_attribute(task, name)
        if value is None:
            continue
        if TASK not in option.scopes:
            raise ConfigurationError(name, f"cannot be set on task {task.name!r}; set it in the app config")
        try:
            option.check(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(name, f"on task {task.name!r}: {exc}") from None
    check_key_templates(task)


#: Task options whose str.format template makes a key that is stored in clear (key tables, the dead letter's
#: idempotency_key, slot holders, the admin): a field that names a secret would put the secret there.
KEY_TEMPLATES = ("idempotency_key", "concurrency_key", "exclusive_key", "ordering_key")


def template_fields(template: str) -> list[str]:
    """Every field a str.format template names, with the nested ones of its format specs (``{n:{width}}``)."""
    found = []
    for _, field, spec, _ in Formatter().parse(template):
        if field is not None:
            found.append(field)
        if spec:
            found += template_fields(spec)
    return found


def field_parts(field: str) -> list[str]:
    """The names a template field reads: ``order.api_token`` -> order, api_token; ``creds[secret]`` -> creds,
    secret (str.format's own grammar: attributes after dots, keys between brackets)."""
    return [part for part in re.split(r"[.\[\]]+", field) if part]


def check_key_templates(task: Any) -> None:
    """Refuse a key template (:data:`KEY_TEMPLATES`, set on the task) one of whose fields, or any part of one
    (``{order.api_token}``, ``{creds[secret]}``), is matched by the task's ``redact_keys`` (a fragment
    anywhere in the name) or ``sensitive_keys`` (its words): ConfigurationError naming task, option and field.

    A callable key cannot be read: it must not return a secret (see the README). A per-call key is a value, not
    a template: not checked here."""
    from celery_guardrails.guardrails.contract import matches

    templates = {name: task_attribute(task, name) for name in KEY_TEMPLATES}
    templates = {name: value for name, value in templates.items() if isinstance(value, str)}
    if not templates:
        return
    redact = [fragment.lower() for fragment in resolve(task, "redact_keys", {})]
    sensitive = tuple(resolve(task, "sensitive_keys", {}))
    for option, template in templates.items():
        try:
            fields = template_fields(template)
        except ValueError:
            continue  # a template str.format cannot parse: refused as a bad key at its first publish
        for field in fields:
            for part in field_parts(field):
                fragment = next((f for f in redact if f in part.lower()), None)
                entry = None if fragment else matches(part, sensitive)
                if fragment or entry:
                    why = f"redact_keys entry {fragment!r}" if fragment else f"sensitive_keys entry {entry!r}"
                    raise ConfigurationError(
                        option,
                        f"on task {task.name!r}: field {{{field}}} names {part!r}, a secret ({why}); the key would "
                        "keep it in clear in the key tables and the dead letter. Make the key from an id instead "
                        "(or a digest the task computes, with a callable key)",
                    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Weakness:
    """A setting that is allowed but makes a guardrail weaker than it looks: ``subject`` (the setting, or the
    task's name) and one sentence saying what is lost."""

    subject: str
    message: str


def weak_settings(settings: Mapping[str, Any], tasks: Iterable[Any] = ()) -> list[Weakness]:
    """The one rule for an empty ``redact_keys`` (app or task): the worker's start-up warning and the audit's
    GA106 (:func:`celery_guardrails.operations.audit.redaction_rules`), ``manage.py check``'s guardrails.W003
    (:func:`warnings_about`)."""
    found = []
    if "redact_keys" in settings and not settings["redact_keys"]:
        found.append(
            Weakness(
                subject="redact_keys",
                message="redact_keys is empty: no value is redacted by its key name in dead letters and logs",
            )
        )
    for task in tasks:
        value = task_attribute(task, "redact_keys")
        if value is not None and not value:
            found.append(
                Weakness(
                    subject=task.name,
                    message=f"redact_keys is empty on task {task.name!r}: nothing of its dead letters is redacted "
                    "by name",
                )
            )
    return found


def warnings_about(settings: Mapping[str, Any], tasks: Iterable[Any] = ()) -> list[str]:
    """Settings that are allowed but make a guardrail weaker than it looks, one sentence each (``manage.py
    check`` shows them; the worker logs them at start-up as the audit's GA106): see :func:`weak_settings`."""
    return [weakness.message for weakness in weak_settings(settings, tasks)]


def import_paths(app: Any, tasks: list[Any]) -> None:
    """Import every option given as a dotted path (the app's and each task's), as a worker starts: a typo
    stops the worker naming the key, instead of surfacing the first time a retry needs it."""
    for name, option in OPTIONS.items():
        if option.check is not _callable_or_path:
            continue
        values = [app_settings(app).get(name), *(task_attribute(task, name) for task in tasks)]
        for value in values:
            if isinstance(value, str):
                try:
                    load(value)
                except ConfigurationError as exc:
                    raise ConfigurationError(name, exc.problem) from None


def check_call_options(call: Mapping[str, Any]) -> dict[str, Any]:
    """Validate per-call options given to ``apply_async``."""
    return validate(call, scope=CALL)


def task_attribute(task: Any, name: str) -> Any:
    """Attribute ``name`` of the task's class (None when unset); unset, what Celery's own option of the same
    meaning says, when the task sets one (:data:`CELERY_EQUIVALENTS`)."""
    # Read from the class: a function given as a decorator kwarg must not become a bound method. A task
    # from @app.task before the app is finalised is a proxy: look through it.
    if isinstance(task, Proxy):
        task = task._get_current_object()
    value = getattr(type(task), name, None)
    if value is None and name in CELERY_EQUIVALENTS:
        return celery_equivalent(type(task), name)
    return value


def _project_class_setting(kind: type, name: str) -> type | None:
    """The class of the project's (before Celery's and the extension's own) that sets ``name``, or None."""
    for klass in kind.__mro__:
        if klass.__module__.partition(".")[0] in ("celery", "celery_guardrails"):
            return None
        if name in vars(klass):
            return klass
    return None


def celery_option(kind: type, name: str) -> Any:
    """Celery task option ``name`` as the task itself sets it (a decorator kwarg or a class attribute of the
    project's), or None: Celery's and the extension's own defaults do not count."""
    klass = _project_class_setting(kind, name)
    return None if klass is None else vars(klass)[name]


def celery_option_set(kind: type, name: str) -> bool:
    """Whether the task sets Celery option ``name`` itself, even to None (``max_retries=None``: for ever)."""
    return _project_class_setting(kind, name) is not None


def _max_attempts_of_celery(kind: type) -> int | None:
    retries = (celery_option(kind, "retry_kwargs") or {}).get("max_retries", celery_option(kind, "max_retries"))
    if isinstance(retries, int) and not isinstance(retries, bool) and retries >= 0:
        return retries + 1
    return None  # unset, or None (Celery's "for ever"): the guardrails' bound applies


def _backoff_base_of_celery(kind: type) -> float | None:
    factor = celery_option(kind, "retry_backoff")
    if factor is True:
        return 1.0
    if isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 0:
        return float(factor)
    return None


def _backoff_max_of_celery(kind: type) -> float | None:
    maximum = celery_option(kind, "retry_backoff_max")
    if isinstance(maximum, int | float) and not isinstance(maximum, bool) and maximum > 0:
        return float(maximum)
    return None


#: Guardrail options a task may set with Celery's own names instead (its autoretry and retry settings): a
#: GuardedTask retries through the guardrails, so Celery's settings are read as theirs.
CELERY_EQUIVALENTS: Mapping[str, Callable[[type], Any]] = {
    "max_attempts": _max_attempts_of_celery,
    "backoff_base": _backoff_base_of_celery,
    "backoff_max": _backoff_max_of_celery,
}
_EQUIVALENT: dict[tuple[type, str], Any] = {}


def celery_equivalent(kind: type, name: str) -> Any:
    """The guardrail option ``name`` as the task class ``kind`` sets it with Celery's own name (cached)."""
    key = (kind, name)
    if key not in _EQUIVALENT:
        _EQUIVALENT[key] = CELERY_EQUIVALENTS[name](kind)
    return _EQUIVALENT[key]


def resolve(task: Any, name: str, call: Mapping[str, Any]) -> Any:
    """The value of option ``name`` for ``task``: per call, then task, then app config, then default.

    Values are returned checked (exception classes loaded, patterns compiled). A per-call value that does
    not pass its check (a tampered or newer message) is logged and skipped, never fatal on the worker.
    """
    option = OPTIONS[name]
    if name in call:
        try:
            return option.check(call[name])
        except (TypeError, ValueError) as exc:
            # Its value is not logged: a per-call key is a value the caller made, and may hold anything.
            logger.warning("Ignoring per-call option %r (%s): %s", name, _kind(call[name]), exc)
    value = task_attribute(task, name)
    if value is not None:
        return _checked(name, value)
    settings = app_settings(task.app)
    if name in settings:
        return settings[name]
    return option.default


def app_value(app: Any, name: str) -> Any:
    """Option ``name`` from the app config, else its default (for work that is not one task's)."""
    return app_settings(app).get(name, OPTIONS[name].default)


def load(value: Any) -> Any:
    """A callable given as a callable or as a dotted path ``package.module.attr``."""
    if not isinstance(value, str):
        return value
    module_name, _, attr = value.rpartition(".")
    try:
        return getattr(import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(value, f"cannot import {value!r}: {exc}") from None
