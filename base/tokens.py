"""The one shape of a hashed bearer secret at rest: operators' API tokens
(``controlplane.ApiToken``), tenants' API keys (``billing.ApiKey``) and node agents' tokens
(``fleet.Node``).

A row keeps the secret's public prefix, which finds the row and names it in lists, and the
SHA-256 of the whole secret (``pdd.tokens``); the secret itself is shown once, when it is
issued, and never stored. ``HashedToken`` holds what the three share: drawing a secret,
reading a secret's prefix, checking a secret against the digest, finding a secret's row and
showing it masked. Each model declares its two fields with ``prefix_field`` and
``digest_field`` and says their names in ``PREFIX_FIELD`` and ``DIGEST_FIELD`` (a node's are
``agent_token_prefix`` and ``agent_token_hash``, which its API shows).

Imported by models modules only, once the app registry has loaded the apps.
"""

from __future__ import annotations

from typing import ClassVar, Self

from django.db import models

from pdd import tokens

# Longest public prefix a row may keep, and the length of a SHA-256 hex digest.
PREFIX_MAX_LENGTH = 16
DIGEST_LENGTH = 64


def prefix_field(help_text: str) -> models.CharField:
    """The public prefix of the secret: unique, so it finds the row; not a secret."""
    return models.CharField(
        max_length=PREFIX_MAX_LENGTH, unique=True, editable=False, help_text=help_text
    )


def digest_field(help_text: str) -> models.CharField:
    """SHA-256 hex of the whole secret."""
    return models.CharField(max_length=DIGEST_LENGTH, editable=False, help_text=help_text)


class HashedToken(models.Model):
    """A row authenticated by a secret of the form ``<scheme><separator><prefix><separator>
    <secret>``, of which it keeps the prefix and the digest."""

    # The names of the model's two fields (declared with prefix_field and digest_field).
    PREFIX_FIELD: ClassVar[str] = "prefix"
    DIGEST_FIELD: ClassVar[str] = "digest"
    # The secrets' form: scheme, separator and random bytes of the prefix (hex).
    scheme: ClassVar[str]
    separator: ClassVar[str]
    prefix_bytes: ClassVar[int]

    class Meta:
        abstract = True

    @classmethod
    def generate(cls) -> str:
        """A fresh secret (256 random bits after the prefix)."""
        return tokens.new_token(cls.scheme, cls.separator, cls.prefix_bytes)[0]

    @classmethod
    def prefix_of(cls, raw: str) -> str | None:
        """The public prefix of a secret of this kind, or None when it is not one."""
        return tokens.token_prefix(raw, cls.scheme, cls.separator)

    @classmethod
    def find(cls, raw: str, queryset: models.QuerySet[Self] | None = None) -> Self | None:
        """The row of ``queryset`` (default: all) that ``raw`` is the secret of, or None for
        a malformed or unknown secret. By the unique prefix, then the digest, compared in
        constant time; whether the row may still be used (revoked, expired...) is the
        caller's to say."""
        prefix = cls.prefix_of(raw)
        if prefix is None:
            return None
        rows = cls._default_manager.all() if queryset is None else queryset
        row = rows.filter(**{cls.PREFIX_FIELD: prefix}).first()
        if row is None or not row.matches(raw):
            return None
        return row

    @property
    def token_prefix(self) -> str:
        return getattr(self, self.PREFIX_FIELD)

    @property
    def token_digest(self) -> str:
        return getattr(self, self.DIGEST_FIELD)

    def set_secret(self, raw: str) -> None:
        """Keep ``raw``'s prefix and digest on the row (not saved here)."""
        prefix = self.prefix_of(raw)
        if prefix is None:
            raise ValueError(f"not a {type(self).__name__} secret")
        setattr(self, self.PREFIX_FIELD, prefix)
        setattr(self, self.DIGEST_FIELD, tokens.digest(raw))

    def new_secret(self) -> str:
        """Draw a fresh secret and keep its prefix and digest on the row (not saved here);
        returns the secret, the only time it exists in the clear."""
        raw = self.generate()
        self.set_secret(raw)
        return raw

    def matches(self, raw: str) -> bool:
        """Whether ``raw`` is this row's secret."""
        return tokens.matches(raw, self.token_digest)

    def masked(self) -> str:
        """The secret as lists show it: its prefix, the rest left out."""
        return f"{self.scheme}{self.separator}{self.token_prefix}{self.separator}..."
