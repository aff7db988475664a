"""What every page of the guardrails admin writes the same way: a long value shortened, whole in its title
(hover, copy from the detail page), and a tenant (an absent one as ``-``). Control and invisible characters are
escaped in both (:mod:`..display`), so that a value cannot reverse or hide the text around it."""

from __future__ import annotations

from django.utils.html import format_html

from ..display import EMPTY, escape


def short_html(text: str, limit: int, css: str = "") -> str:
    """``text`` cut to ``limit`` characters, whole in its title (hover, copy from the detail page); control and
    invisible characters escaped in both (:mod:`..display`); ``css`` is the span's class, when it needs one."""
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    if css:
        return format_html('<span class="{}" title="{}">{}</span>', css, escape(text), escape(shown, html=True))
    return format_html('<span title="{}">{}</span>', escape(text), escape(shown, html=True))


def tenant_html(tenant: str | None, limit: int = 16) -> str:
    """A tenant as every page shows it: shortened (whole on hover), and an absent one as ``-``."""
    return short_html(tenant, limit) if tenant else EMPTY
