"""A staff user of the admin, logged in, with the guardrails permissions a test gives it."""

from __future__ import annotations

import uuid

from django.contrib.auth.models import Permission, User
from django.test import Client


def staff_user(*codenames: str) -> User:
    """A new staff user who may view dead letters, and do what ``codenames`` allow (read back: no cached perms)."""
    user = User.objects.create_user(f"u{uuid.uuid4().hex[:8]}", password="pw", is_staff=True)
    wanted = ["view_deadletter", *codenames]
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="guardrails", codename__in=wanted))
    return User.objects.get(pk=user.pk)


def logged_in(*codenames: str) -> Client:
    """A client logged in as a new :func:`staff_user`."""
    client = Client()
    client.force_login(staff_user(*codenames))
    return client
