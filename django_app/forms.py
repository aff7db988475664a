"""Forms of the admin pages that change dead letters.

The arguments are edited as JSON, and whatever is posted is a form error, never a 500 or a message a worker
cannot take: text that is not JSON (``NaN`` and ``Infinity`` included: Python reads them, JSON and PostgreSQL do
not), nesting deeper than :data:`MAX_DEPTH` (a deeper value fails the parser's recursion, the replay's walks
or a prefork worker's hand-over), a number past Python's 4,300 digits, a lone surrogate (no page or message
can encode it). The body as a whole is bounded by Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (a 400).
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.forms.fields import InvalidJSONInput
from django.utils.translation import gettext_lazy as _

from celery_guardrails.exceptions import ContextError
from celery_guardrails.foundation.context import validate_tenant

from .display import escape

#: Levels of nesting an edited argument may have (a list or an object inside another counts one more).
MAX_DEPTH = 100


class ArgumentsField(forms.JSONField):
    """A JSON field that turns every way the text can fail into a form error (see the module docstring), and
    shows a value with its control and invisible characters escaped (the same JSON, readable as stored)."""

    default_error_messages = {
        "deep": _("Nested more than %(depth)s levels deep: give a flatter value."),
        "constant": _("%(constant)s is not JSON: give a number or a string."),
        "surrogate": _("A lone surrogate (%(escape)s) is not text: give whole characters."),
    }

    def to_python(self, value: Any) -> Any:
        if self.disabled or value in self.empty_values or not isinstance(value, str):
            return super().to_python(value)
        return self._parsed(value)

    def bound_data(self, data: Any, initial: Any) -> Any:
        # Django parses the posted text again to show it: a text that failed is shown as typed.
        if self.disabled or not isinstance(data, str):
            return super().bound_data(data, initial)
        try:
            return self._parsed(data)
        except forms.ValidationError:
            return InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> Any:
        prepared = super().prepare_value(value)
        return prepared if isinstance(value, InvalidJSONInput) else escape(prepared)

    def _parsed(self, text: str) -> Any:
        def constant(name: str) -> Any:
            raise forms.ValidationError(self.error_messages["constant"], code="constant", params={"constant": name})

        try:
            value = json.loads(text, parse_constant=constant)
        except json.JSONDecodeError:
            raise forms.ValidationError(
                self.error_messages["invalid"], code="invalid", params={"value": text}
            ) from None
        except RecursionError:
            raise self._too_deep() from None
        except ValueError as exc:  # a number past int's digit limit
            raise forms.ValidationError(str(exc)[:200], code="invalid") from None
        _check(value, self._too_deep, str(self.error_messages["surrogate"]))
        return value

    def _too_deep(self) -> forms.ValidationError:
        return forms.ValidationError(self.error_messages["deep"], code="deep", params={"depth": MAX_DEPTH})


def _check(value: Any, too_deep: Any, surrogate: str) -> None:
    """Walk ``value`` without recursion: its depth, and its text (keys too) for lone surrogates."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError as exc:
                shown = escape(item[exc.start : exc.end])
                raise forms.ValidationError(surrogate, code="surrogate", params={"escape": shown}) from None
        elif isinstance(item, list | dict):
            if depth >= MAX_DEPTH:
                raise too_deep()
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)


class ShownTextField(forms.CharField):
    """A text field that shows its value with control and invisible characters escaped (a record's tenant as
    stored); such a value is refused when posted (validate_tenant), so the operator sees why and fixes it."""

    def prepare_value(self, value: Any) -> Any:
        return escape(value) if isinstance(value, str) else value


class EditAndReplayForm(forms.Form):
    """A dead letter's fix before its replay: the tenant, the arguments (shown redacted, edited as JSON)."""

    tenant = ShownTextField(
        label=_("tenant"),
        required=False,
        help_text=_("The tenant the replay runs as; blank: as recorded."),
    )
    # Not required: Django's JSONField takes [] and {} for "no value", and a task without positional or keyword
    # arguments (most) could not be edited and replayed at all. A blank field is still refused, by clean_*.
    args = ArgumentsField(
        label=_("arguments"),
        required=False,
        help_text=_('A JSON list. A value left as "[redacted]" is replayed with the original from the sealed copy.'),
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
    )
    kwargs = ArgumentsField(
        label=_("keyword arguments"),
        required=False,
        help_text=_('A JSON object. A value left as "[redacted]" is replayed with the original from the sealed copy.'),
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}),
    )

    def __init__(self, *args: Any, not_idempotent: bool = False, **kwargs: Any) -> None:
        """``not_idempotent``: the record's task may already have acted; the form then has an unticked box that
        must be ticked for the replay to run it (replay_with_changes(..., allow_not_idempotent=True))."""
        super().__init__(*args, **kwargs)
        if not_idempotent:
            self.fields["allow_not_idempotent"] = forms.BooleanField(
                label=_("I checked that the effect did not happen; replay it anyway"),
                required=False,  # unticked is an answer too: the replay is then refused, the record stays open
                initial=False,
                help_text=_(
                    "This task failed after it may already have acted (charged a card, sent a mail): replaying "
                    "runs it again and may repeat that effect."
                ),
            )

    def clean_tenant(self) -> str:
        tenant: str = self.cleaned_data["tenant"].strip()
        if tenant:
            try:
                validate_tenant(tenant)
            except ContextError as exc:
                raise forms.ValidationError(str(exc)) from None
        return tenant

    def clean_args(self) -> list[Any]:
        value = self.cleaned_data["args"]
        if not isinstance(value, list):
            raise forms.ValidationError(_('Give a JSON list, such as [42, "EUR"], or [] for none.'))
        return value

    def clean_kwargs(self) -> dict[str, Any]:
        value = self.cleaned_data["kwargs"]
        if not isinstance(value, dict):
            raise forms.ValidationError(_('Give a JSON object, such as {"amount": 10}, or {} for none.'))
        return value
