"""Create or update an API user with a role (operator or viewer) and print its API token."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from rest_framework.authtoken.models import Token

ROLES = ("operator", "viewer")


class Command(BaseCommand):
    help = "Create or update a user with the operator or viewer role and print its API token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", choices=ROLES, default="viewer")
        parser.add_argument("--password", help="Also set a password for the web UI and admin.")
        parser.add_argument(
            "--rotate-token", action="store_true", help="Replace an existing API token."
        )

    @transaction.atomic
    def handle(
        self, *args, username: str, role: str, password: str | None, rotate_token: bool, **kw
    ):
        if not username.strip():
            raise CommandError("username must not be empty")
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(username=username)
        operator_group, _ = Group.objects.get_or_create(name=settings.BATON_OPERATOR_GROUP)
        viewer_group, _ = Group.objects.get_or_create(name=settings.BATON_VIEWER_GROUP)
        user.groups.remove(operator_group, viewer_group)
        user.groups.add(operator_group if role == "operator" else viewer_group)
        # Operators may use the admin too; viewers never are staff.
        user.is_staff = role == "operator"
        if password:
            user.set_password(password)
        elif created:
            user.set_unusable_password()
        user.save()
        if rotate_token:
            Token.objects.filter(user=user).delete()
        token, _ = Token.objects.get_or_create(user=user)
        verb = "created" if created else "updated"
        self.stderr.write(f"{role} {username} {verb}")
        self.stdout.write(token.key)
