"""``{% load guardrails %}``: the ``visible`` filter, a stored value with its control and invisible characters
written out (see :mod:`django_celery_guardrails.display`).

``{{ value|visible }}`` is HTML with each escape marked; ``{{ value|visible:"lines" }}`` keeps newlines and tabs
(a traceback in a ``<pre>``); ``{{ value|visible:"text" }}`` is the plain escaped text, for a page title or an
attribute (which the template then escapes as usual). ``{% visible_style %}`` is the style of the marks.
"""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString, mark_safe

from ..display import ESCAPE_STYLE, escape

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
