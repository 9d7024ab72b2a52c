"""Tenants, their hashed API keys, and the usage ledger keyed by request id."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from fleet.validators import slug_name


class Tenant(models.Model):
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[slug_name],
        help_text="Short unique name, e.g. 'acme'.",
    )
    display_name = models.CharField(
        max_length=128,
        blank=True,
        help_text="Name shown in reports.",
    )
    requests_per_minute = models.PositiveIntegerField(
        default=600,
        validators=[MinValueValidator(1), MaxValueValidator(10_000_000)],
        help_text="Most requests the tenant may start per minute.",
    )
    # 64-bit: the validator allows 10^10, beyond PostgreSQL's 32-bit integer.
    tokens_per_minute = models.PositiveBigIntegerField(
        default=2_000_000,
        validators=[MinValueValidator(1), MaxValueValidator(10_000_000_000)],
        help_text="Most prompt + max output tokens the tenant may ask for per minute.",
    )
    active = models.BooleanField(
        default=True,
        help_text="Inactive tenants' keys are refused.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.display_name or self.name


class ApiKey(models.Model):
    tenant = models.ForeignKey(
        "billing.Tenant",
        on_delete=models.CASCADE,
        related_name="api_keys",
        help_text="The tenant the key bills to.",
    )
    name = models.CharField(
        max_length=64,
        blank=True,
        help_text="What the key is for, e.g. 'ci' or 'laptop'.",
    )
    prefix = models.CharField(
        max_length=16,
        unique=True,
        editable=False,
        help_text="Visible part of the key (shown in lists so people can tell keys apart).",
    )
    key_hash = models.CharField(
        max_length=64,
        editable=False,
        help_text="SHA-256 of the whole key; the key itself is shown once and never stored.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the key was revoked; revoked keys are refused.",
    )
    last_used_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the key last authenticated a request (updated at most once a minute).",
    )

    class Meta:
        ordering = ["tenant__name", "-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        state = "revoked" if self.revoked_at else "active"
        return f"sk-baton-{self.prefix}... ({self.tenant.name}, {state})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and self.tenant.active


class UsageEntry(models.Model):
    """One line of the ledger per request; the request id makes writing it idempotent."""

    request_id = models.CharField(
        max_length=64,
        unique=True,
        help_text="The gateway's request id; a retry of the same write is a no-op.",
    )
    tenant = models.ForeignKey(
        "billing.Tenant",
        on_delete=models.PROTECT,
        related_name="usage",
        help_text="Who is billed.",
    )
    api_key = models.ForeignKey(
        "billing.ApiKey",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="usage",
        help_text="The key used.",
    )
    model = models.CharField(
        max_length=128,
        help_text="Served model name.",
    )
    prompt_tokens = models.PositiveIntegerField(help_text="Input tokens, cached ones included.")
    cached_tokens = models.PositiveIntegerField(
        help_text="Input tokens served from a prefix cache."
    )
    completion_tokens = models.PositiveIntegerField(help_text="Output tokens.")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "usage entries"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(cached_tokens__lte=models.F("prompt_tokens")),
                name="usage_cached_within_prompt",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.request_id}: {self.tenant.name} {self.prompt_tokens}+{self.completion_tokens}"
        )
