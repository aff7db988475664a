"""``{% load guardrails %}``: the ``visible`` filter, a stored value with its control and invisible characters
written out (see :mod:`django_celery_guardrails.display`).

``{{ value|visible }}`` is HTML with each escape marked; ``{{ value|visible:"lines" }}`` keeps newlines and tabs
(a traceback in a ``<pre>``); ``{{ value|visible:"text" }}`` is the plain escaped text, for a page title or an
attribute (which the template then escapes as usual). ``{% visible_style %}`` is the style of the marks.

``{{ when|moment }}`` writes a moment as every page does (``2026-12-02 10:31:05 UTC``, the current time zone),
``{{ when|ago }}`` how long ago it was, ``{{ seconds|span }}`` a length of time (``4 min 5 s``).
"""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString, mark_safe

from ..display import ESCAPE_STYLE, ago, escape, moment, span

register = template.Library()
MODES = ("", "lines", "text")


@register.filter(is_safe=False)
def visible(value: object, mode: str = "") -> str:
    if mode not in MODES:
        raise template.TemplateSyntaxError(f"visible: mode {mode!r} is not one of {', '.join(map(repr, MODES))}")
    return escape(value, multiline=mode == "lines", html=mode != "text")


@register.simple_tag
def visible_style() -> SafeString:
    return mark_safe(f"<style>{ESCAPE_STYLE}</style>")  # a constant


# Times as every page writes them (see django_celery_guardrails.display); plain text, escaped by the template.
register.filter("moment", moment)
register.filter("ago", ago)
register.filter("span", span)
