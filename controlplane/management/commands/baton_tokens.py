"""List operators' and viewers' API tokens by prefix, or revoke one.

manage.py baton_tokens alice              # alice's tokens
manage.py baton_tokens                    # everyone's
manage.py baton_tokens --revoke bat_x1y2z3w4
manage.py baton_tokens --convert-drf      # hash DRF plaintext tokens left in authtoken_token
"""

from __future__ import annotations

import importlib

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.utils import timezone

from controlplane.models import PREFIX_LENGTH, ApiToken


def _convert_migration():
    return importlib.import_module("controlplane.migrations.0002_convert_drf_tokens")


def _when(value) -> str:
    return f"{value:%Y-%m-%d %H:%M}" if value else "-"


class Command(BaseCommand):
    help = (
        "List API tokens (prefix, user, name, created, last used, expiry, state), or revoke one "
        "by its prefix."
    )

    def add_arguments(self, parser):
        parser.add_argument("username", nargs="?", help="Only this user's tokens.")
        parser.add_argument("--revoke", metavar="PREFIX", help="Revoke the token with this prefix.")
        parser.add_argument(
            "--active", action="store_true", help="List only tokens that still work."
        )
        parser.add_argument(
            "--convert-drf",
            action="store_true",
            help=(
                "Move plaintext rows of DRF's authtoken_token (e.g. bulk-created ones) into "
                "hashed API tokens, as the migration did; their keys keep working."
            ),
        )

    def handle(
        self,
        *args,
        username: str | None,
        revoke: str | None,
        active: bool,
        convert_drf: bool,
        **kw,
    ):
        if convert_drf:
            with transaction.atomic():
                moved = _convert_migration().convert_plaintext_tokens(ApiToken, connection)
            self.stderr.write(f"converted {moved} DRF plaintext token(s) into API tokens")
            return
        tokens = ApiToken.objects.select_related("user").order_by("user__username", "-created_at")
        if username:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"no user {username!r}")
            tokens = tokens.filter(user=user)
        if revoke:
            self._revoke(tokens, revoke)
            return
        now = timezone.now()
        rows = [
            (
                t.prefix,
                t.user.username,
                t.name or "-",
                _when(t.created_at),
                _when(t.last_used_at),
                _when(t.expires_at),
                t.state(now),
            )
            for t in tokens
            if not active or t.state(now) == "active"
        ]
        if not rows:
            self.stderr.write("no API tokens")
            return
        header = ("PREFIX", "USER", "NAME", "CREATED", "LAST USED", "EXPIRES", "STATE")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            line = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
            self.stdout.write(line.rstrip())

    @transaction.atomic
    def _revoke(self, tokens, prefix: str) -> None:
        # A whole key pasted by mistake still names its token (and is not echoed back).
        token = tokens.select_for_update().filter(prefix=prefix[:PREFIX_LENGTH]).first()
        if token is None:
            raise CommandError(f"no API token with prefix {prefix[:PREFIX_LENGTH]!r}")
        if token.revoked_at is not None:
            self.stderr.write(f"{token.prefix} of {token.user.username} was already revoked")
            return
        token.revoke()
        self.stderr.write(f"revoked {token.prefix} of {token.user.username} ({token.name or '-'})")
