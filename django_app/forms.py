"""Forms of the admin pages that change dead letters."""

from __future__ import annotations

from typing import Any

from django import forms
from django.utils.translation import gettext_lazy as _

from celery_guardrails.context import validate_tenant
from celery_guardrails.exceptions import ContextError


class EditAndReplayForm(forms.Form):
    """A dead letter's fix before its replay: the tenant, the arguments (shown redacted, edited as JSON)."""

    tenant = forms.CharField(
        label=_("tenant"),
        required=False,
        help_text=_("The tenant the replay runs as; blank: as recorded."),
    )
    # Not required: Django's JSONField takes [] and {} for "no value", and a task without positional or keyword
    # arguments (most) could not be edited and replayed at all. A blank field is still refused, by clean_*.
    args = forms.JSONField(
        label=_("arguments"),
        required=False,
        help_text=_('A JSON list. A value left as "[redacted]" is replayed with the original from the sealed copy.'),
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
    )
    kwargs = forms.JSONField(
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
