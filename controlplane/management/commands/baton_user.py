"""Create or update an API user with a role (operator or viewer) and print a new API token.

Tokens are stored hashed (controlplane.models.ApiToken), so an existing key cannot be printed
again: every run issues a new token and prints it, the one line on stdout. Without
``--rotate-token`` the user's earlier tokens keep working (stderr says how many);
with it they are revoked first. ``manage.py baton_tokens`` lists and revokes tokens.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from controlplane.models import ApiToken

ROLES = ("operator", "viewer")


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of days, at least 1: {value!r}")
    return number


class Command(BaseCommand):
    help = (
        "Create or update a user with the operator or viewer role, issue a new API token and "
        "print it (shown once: only its hash is stored)."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", choices=ROLES, default="viewer")
        parser.add_argument("--password", help="Also set a password for the web UI and admin.")
        parser.add_argument(
            "--rotate-token",
            action="store_true",
            help="Revoke the user's existing API tokens before issuing the new one.",
        )
        parser.add_argument(
            "--name", default="cli", help="What the new token is for (default: cli)."
        )
        parser.add_argument(
            "--expires-in-days",
            type=positive_int,
            metavar="N",
            help="The new token expires after N days (default: never).",
        )

    @transaction.atomic
    def handle(
        self,
        *args,
        username: str,
        role: str,
        password: str | None,
        rotate_token: bool,
        name: str,
        expires_in_days: int | None,
        **kw,
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
        verb = "created" if created else "updated"
        self.stderr.write(f"{role} {username} {verb}")

        now = timezone.now()
        active = ApiToken.objects.filter(user=user, revoked_at__isnull=True).exclude(
            expires_at__lte=now
        )
        earlier = [token.prefix for token in active]
        if rotate_token and earlier:
            active.update(revoked_at=now)
            self.stderr.write(f"revoked {len(earlier)} earlier API token(s): {', '.join(earlier)}")
        expires_in = timedelta(days=expires_in_days) if expires_in_days else None
        token, key = ApiToken.objects.issue(user=user, name=name, expires_in=expires_in)
        expiry = f"expires {token.expires_at:%Y-%m-%d %H:%M} UTC" if expires_in else "no expiry"
        self.stderr.write(f"issued API token {token.prefix} ({name}, {expiry}); shown once")
        if earlier and not rotate_token:
            self.stderr.write(
                f"{len(earlier)} earlier API token(s) still work ({', '.join(earlier)}); "
                "--rotate-token revokes them, manage.py baton_tokens lists them"
            )
        self.stdout.write(key)
