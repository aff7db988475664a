"""How the shop knows its tenant: the ``X-Tenant`` header (a real project would use the host or the user)."""

from django.http import HttpRequest


def tenant_from_header(request: HttpRequest) -> str | None:
    return request.headers.get("X-Tenant") or None
