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
from itertools import groupby
from typing import Any, cast

from django.contrib.admin.utils import display_for_field
from django.db import models
from django.utils.html import escape as html_escape
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
        if field.choices or not isinstance(field, models.CharField | models.TextField):
            shown = display_for_field(value, field, EMPTY)  # dates in the user's zone, a boolean's icon
            return shown if isinstance(shown, SafeString) else escape(shown, html=True)
        text = escape(value, multiline=multiline, html=True)
        return mark_safe(text.replace("\n", "<br>")) if multiline else text  # escaped above

    show.__name__ = show.__qualname__ = name
    show.short_description = field.verbose_name  # type: ignore[attr-defined]
    return show
