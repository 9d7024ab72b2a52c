"""API tokens of operators and viewers, kept hashed at rest.

A key looks like ``bat_<8 characters>_<secret>``; its first 12 characters (``bat_`` and the
eight) are the token's public ``prefix``, which names it in lists and logs and finds its row.
Only the SHA-256 of the whole key is stored: the key is shown once, when it is issued.

Keys converted from DRF's ``rest_framework.authtoken`` (40 hex characters) keep working; their
prefix is likewise their first 12 characters.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.apps import apps as django_apps
from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.db.models.signals import post_save
from django.utils import timezone

from base.tokens import HashedToken, digest_field, prefix_field

KEY_SCHEME = "bat"
# Length of the public prefix: "bat_" and 8 random characters for issued keys.
PREFIX_LENGTH = 12
_PREFIX_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# last_used_at is written at most this often per token, not on every request.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def key_prefix(key: str) -> str:
    """The public prefix that identifies (and finds) the token of a key."""
    return key[:PREFIX_LENGTH]


def generate_key() -> str:
    ident = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    return f"{KEY_SCHEME}_{ident}_{secrets.token_urlsafe(32)}"


class ApiTokenManager(models.Manager["ApiToken"]):
    def issue(
        self,
        *,
        user,
        name: str = "",
        expires_at: datetime | None = None,
        expires_in: timedelta | None = None,
    ) -> tuple[ApiToken, str]:
        """A new token for ``user``, with its key: the only time the key exists in the clear."""
        if expires_in is not None:
            expires_at = timezone.now() + expires_in
        for _ in range(5):
            token = self.model(user=user, name=name, expires_at=expires_at)
            key = token.new_secret()
            try:
                with transaction.atomic():
                    token.save(force_insert=True)
            except IntegrityError:
                # Two keys with one prefix (36^8 of them): draw again.
                if self.filter(prefix=token.prefix).exists():
                    continue
                raise
            return token, key
        raise RuntimeError("could not draw an unused API token prefix")  # pragma: no cover

    def import_key(
        self, *, user_id: int, key: str, name: str = "", created_at: datetime | None = None
    ) -> ApiToken:
        """Keep an existing key (e.g. a DRF token's) working, storing only its digest."""
        existing = self.model.find(key, self.all())
        if existing is not None:
            return existing  # already imported (a DRF token saved twice)
        token = self.model(user_id=user_id, name=name, created_at=created_at or timezone.now())
        token.set_secret(key)
        token.save(force_insert=True, using=self.db)
        return token


class ApiToken(HashedToken):
    """An operator's or viewer's credential for the REST API (``Authorization: Token <key>``).

    Its keys are ``bat_<8 characters>_<secret>`` (or a converted DRF key), and the prefix is a
    key's first PREFIX_LENGTH characters, scheme included (generate, prefix_of)."""

    scheme = KEY_SCHEME
    separator = "_"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="api_tokens",
        help_text="The user the token authenticates as; the user's role decides what it may do.",
    )
    name = models.CharField(
        max_length=64, blank=True, help_text="What the token is for, e.g. 'ci' or 'laptop'."
    )
    prefix = prefix_field("Public first characters of the key: names the token in lists and logs.")
    digest = digest_field(
        "SHA-256 hex of the whole key; the key itself is shown once and never stored."
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When the token last authenticated a request (updated at most once a minute).",
    )
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="Refused from this time on; empty: never expires."
    )
    revoked_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When the token was revoked; revoked tokens are refused.",
    )

    objects = ApiTokenManager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix} ({self.state()})"

    @classmethod
    def generate(cls) -> str:
        return generate_key()

    @classmethod
    def prefix_of(cls, raw: str) -> str:
        return key_prefix(raw)

    def masked(self) -> str:
        return f"{self.prefix}..."

    def is_expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    def state(self, now: datetime | None = None) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.is_expired(now):
            return "expired"
        return "active"

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])

    def touch(self, now: datetime | None = None) -> None:
        """Record a use, writing at most once per LAST_USED_RESOLUTION."""
        now = now or timezone.now()
        if self.last_used_at is None or now - self.last_used_at >= LAST_USED_RESOLUTION:
            self.last_used_at = now
            ApiToken.objects.filter(pk=self.pk).update(last_used_at=now)


# Compatibility with DRF's authtoken while it stays installed: code that still does
# ``Token.objects.create(user=u).key`` (drf_create_token, third-party code, old tests) gets a
# key that works, but the plaintext row is replaced at once by a hashed ApiToken.
DRF_TOKEN_NAME = "rest_framework.authtoken"


def _move_drf_token(sender, instance, created: bool, raw: bool = False, **kwargs) -> None:
    if not created:
        return
    ApiToken.objects.import_key(user_id=instance.user_id, key=instance.key, name=DRF_TOKEN_NAME)
    # The instance keeps its .key for the caller; the row holding it in the clear goes.
    # (By key: TokenProxy, DRF's admin model, answers .pk with the user's id.)
    sender.objects.filter(key=instance.key).delete()


if django_apps.is_installed("rest_framework.authtoken"):
    for _model in ("authtoken.Token", "authtoken.TokenProxy"):
        post_save.connect(_move_drf_token, sender=_model, dispatch_uid=f"move-drf-token:{_model}")
