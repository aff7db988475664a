"""Stored values shown as they are: control and invisible characters written out, never obeyed.

A dead letter holds what a message carried, and a message can carry anything: a bidi override (U+202E) makes
``RTL\\u202egnp.exe`` read ``RTLexe.png``, a zero-width space makes two different ids look the same, a carriage
return or a newline forges a line of a command's output. :func:`escape` writes each such character as its
escape (``\\u202e``, ``\\u001b``, ``\\r``; past U+FFFF a surrogate pair, as JSON writes it: escaped JSON is
still the same JSON), so the value reads as what is stored. It is the one function
every page and command shows stored values through: the templates by the ``visible`` filter
(``{% load guardrails %}``), the admin's columns and fields, the dashboard's charts and the commands' text
output.

Escaped: every character of Unicode's categories Cc (C0 and C1 controls, DEL), Cf (format: bidi embeddings,
overrides and isolates U+202A-U+202E and U+2066-U+2069, the marks U+200E, U+200F and U+061C, zero-width
U+200B-U+200D, U+2060, U+FEFF, soft hyphen, tag characters), Zl and Zp (U+2028, U+2029), and Cs (a lone
surrogate, which no page could even encode). A newline and a tab are kept where a value is shown on several
lines (a traceback: ``multiline=True``). In HTML each escape is a ``<span class="gr-escaped">`` (styled by the
pages) whose title names the code point, so it stands apart from a backslash typed in the value; in text (a
command, a page title, a tooltip) it is the bare escape.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from datetime import datetime
from itertools import groupby
from typing import Any, cast

from django.contrib.admin.utils import display_for_field
from django.db import models
from django.utils import timezone
from django.utils.html import escape as html_escape
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

#: What an empty value shows as (the admin's own default).
EMPTY = "-"

#: Unicode categories written out (see the module docstring).
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
#: Escapes written short.
SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: Kept as they are in a value shown on several lines.
KEPT_IN_LINES = frozenset("\n\t")
#: The HTML of one escaped character: a class for the pages' style, the code point on hover.
ESCAPE_HTML = '<span class="gr-escaped" title="U+{code:04X}">{text}</span>'
#: The style the pages give it (in the admin's own colours, light and dark).
ESCAPE_STYLE = (
    ".gr-escaped { font-family: monospace; font-size: 0.9em; color: var(--error-fg, #ba2121); "
    "background: var(--darkened-bg, #f8f8f8); border: 1px dotted currentColor; border-radius: 2px; "
    "padding: 0 1px; }"
)


def _written(character: str) -> str:
    if character in SHORT:
        return SHORT[character]
    code = ord(character)
    if code < 0x10000:
        return f"\\u{code:04x}"
    # Past the BMP, as JSON writes it (a surrogate pair): the escaped text of a JSON value is still that JSON.
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _hidden(character: str, multiline: bool) -> bool:
    return unicodedata.category(character) in ESCAPED_CATEGORIES and not (multiline and character in KEPT_IN_LINES)


def escape(value: object, *, multiline: bool = False, html: bool = False) -> str:
    """``value`` (made text with ``str``) with its control and invisible characters written as escapes: plain
    text, or with ``html=True`` HTML-escaped text whose escapes are marked (a :class:`SafeString`)."""
    text = "" if value is None else str(value)
    # Most values hold none of them: one pass in C says so (isprintable is False for every escaped category).
    if text.isprintable() or not any(_hidden(c, multiline) for c in text):
        return SafeString(html_escape(text)) if html else text
    pieces = []
    for hidden, run in groupby(text, key=lambda c: _hidden(c, multiline)):
        if not hidden:
            shown = "".join(run)
            pieces.append(html_escape(shown) if html else shown)
        elif html:
            pieces.extend(ESCAPE_HTML.format(code=ord(c), text=_written(c)) for c in run)
        else:
            pieces.extend(_written(c) for c in run)
    joined = "".join(pieces)
    return mark_safe(joined) if html else joined  # every piece escaped above


def json_text(value: Any) -> str:
    """``value`` as JSON on one line, its characters as they are (then :func:`escape` them to show it)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def shown_field(model: type[models.Model], name: str, *, multiline: bool = False) -> Callable[[Any], str]:
    """A read-only admin field showing ``model``'s field ``name`` through :func:`escape`: JSON on one line, text
    (on several lines with ``multiline``), other values as the admin shows them. A function named after the
    field, so that the page keeps the field's label, help text and CSS class (``field-<name>``)."""
    field = cast(models.Field, model._meta.get_field(name))  # type: ignore[type-arg]

    def show(obj: Any) -> str:
        value = getattr(obj, field.attname)
        if isinstance(field, models.JSONField):
            return escape(json_text(value), html=True)
        if value in (None, "") and not isinstance(field, models.BooleanField):
            return EMPTY
        if isinstance(field, models.DateTimeField):  # the pages' one format (:func:`moment`), "3 min ago" on hover
            return moment_html(value)
        if field.choices or not isinstance(field, models.CharField | models.TextField):
            shown = display_for_field(value, field, EMPTY)  # dates in the user's zone, a boolean's icon
            return shown if isinstance(shown, SafeString) else escape(shown, html=True)
        text = escape(value, multiline=multiline, html=True)
        return mark_safe(text.replace("\n", "<br>")) if multiline else text  # escaped above

    show.__name__ = show.__qualname__ = name
    show.short_description = field.verbose_name  # type: ignore[attr-defined]
    return show


# Moments: one way every page writes them.

#: A moment on every page: ISO-like, in the current time zone (the user's, else TIME_ZONE), its name after
#: (``2026-12-02 10:31:05 UTC``); the same text everywhere, so two pages' times compare at a glance.
MOMENT_FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def as_moment(value: object) -> datetime | None:
    """``value`` as an aware datetime: a datetime, or the ISO-8601 text an attempt record holds; None when it is
    neither (an empty or unreadable value)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    # A naive one is a database's time with USE_TZ off: in the current time zone, as Django reads it
    return value if timezone.is_aware(value) else timezone.make_aware(value)


def moment(value: object) -> str:
    """``value`` (see :func:`as_moment`) as :data:`MOMENT_FORMAT` in the current time zone; :data:`EMPTY`
    when there is none, an unreadable text as it is (escaped by the caller)."""
    found = as_moment(value)
    if found is None:
        return EMPTY if value in (None, "") else str(value)
    return timezone.localtime(found).strftime(MOMENT_FORMAT)


def ago(value: object, *, now: datetime | None = None) -> str:
    """How long before ``now`` ``value`` was (``3 min ago``, ``in 4 min``, ``just now``): "" when there is no
    moment."""
    found = as_moment(value)
    if found is None:
        return ""
    seconds = ((now or timezone.now()) - found).total_seconds()
    span = abs(seconds)
    if span < 45:
        return "just now"
    if span < 90 * 60:
        text = f"{max(1, round(span / 60))} min"
    elif span < 36 * 3600:
        text = f"{round(span / 3600)} h"
    else:
        text = f"{round(span / 86400)} days"
    return f"{text} ago" if seconds >= 0 else f"in {text}"


def moment_html(value: object, *, relative: bool = False, now: datetime | None = None) -> str:
    """A ``<time>`` element: :func:`moment`'s text, the relative time (:func:`ago`) on hover, or under it with
    ``relative=True``; :data:`EMPTY` when there is no moment."""
    found = as_moment(value)
    if found is None:
        return escape(moment(value), html=True)
    since = ago(found, now=now)
    shown = format_html('<time datetime="{}" title="{}">{}</time>', found.isoformat(), since, moment(found))
    return format_html('{}<br><span class="gr-ago">{}</span>', shown, since) if relative else shown


def time_column(name: str, description: str, *, relative: bool = False) -> Callable[[Any], str]:
    """A change-list column showing the date and time field ``name`` as :func:`moment_html` (sortable by it),
    in place of the admin's own format (``Dec. 2, 2026, 10:31 a.m.``), so that lists and pages agree."""

    def show(obj: Any) -> str:
        return moment_html(getattr(obj, name), relative=relative)

    show.__name__ = show.__qualname__ = f"{name}_shown"
    show.short_description = description  # type: ignore[attr-defined]
    show.admin_order_field = name  # type: ignore[attr-defined]
    return show


# One line that tells two records apart: their error and their arguments.

#: What redaction writes in place of a value (celery_guardrails.foundation.redaction.REDACTED): shown bare, never
# quoted.
REDACTED_MARK = "[redacted]"


def _value(value: Any) -> str:
    if isinstance(value, str) and value.startswith(REDACTED_MARK):
        return REDACTED_MARK  # a redacted or cut value: the mark only ("(cut: ...)" is on the record's page)
    return json_text(value)


def arguments_line(args: Any, kwargs: Any, *, names: list[str] | tuple[str, ...] = (), as_repr: bool = False) -> str:
    """A call's stored (redacted) arguments on one line, as a call reads: ``order_id=42, amount_cents=1200``.

    Positional values are named by ``names`` (the task's parameters, when the task is known here), else shown
    by value; redacted values stay ``[redacted]``; arguments stored as text (``as_repr``) show that text."""
    if as_repr:
        return f"as text: {args[0] if isinstance(args, list) and args else args}"
    positional = args if isinstance(args, list) else [args]
    named = kwargs if isinstance(kwargs, dict) else {"kwargs": kwargs}
    parts = [
        f"{names[index]}={_value(value)}" if index < len(names) else _value(value)
        for index, value in enumerate(positional)
    ]
    parts.extend(f"{key}={_value(value)}" for key, value in named.items())
    return ", ".join(parts) or "(none)"


def error_line(exc_type: str, exc_message: str) -> str:
    """The error as one line: the exception's class without its module, then its (redacted) message, lines
    joined: ``HTTPError: 503 Server Error: Service Unavailable``."""
    name = exc_type.rpartition(".")[2]
    message = " ".join(exc_message.split())
    return f"{name}: {message}" if name and message else name or message or EMPTY


def span(seconds: float | None) -> str:
    """A length of time a person reads at a glance: ``0.4 s``, ``42 s``, ``4 min 5 s``, ``2 h 7 min``,
    ``3 days 4 h``; :data:`EMPTY` for none."""
    if seconds is None:
        return EMPTY
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} days {hours} h" if hours else f"{days} days"
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{minutes} min {secs} s" if secs else f"{minutes} min"
