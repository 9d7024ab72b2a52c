"""Tenants, their hashed API keys, the usage ledger keyed by request id, and the price book."""

from __future__ import annotations

from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from base.tokens import HashedToken, digest_field, prefix_field
from billing.amounts import component
from fleet.models.pricing import EffectivePeriodQuerySet, PeriodPrice
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


KEY_SCHEME = "sk-baton"


class ApiKey(HashedToken):
    """A tenant's key for the OpenAI-compatible API: ``sk-baton-<8 hex>-<secret>``, kept as
    its prefix and digest (base/tokens.py)."""

    scheme = KEY_SCHEME
    separator = "-"
    prefix_bytes = 4

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
    prefix = prefix_field("Visible part of the key (shown in lists so people can tell keys apart).")
    digest = digest_field(
        "SHA-256 of the whole key; the key itself is shown once and never stored."
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


class UsageEntryQuerySet(models.QuerySet):
    def select_related(self, *fields):
        # "statement" used to be a foreign key; it is a computed property now (see
        # UsageEntry.statement). Accept it here so callers written for the key keep working.
        fields = tuple(f for f in fields if f != "statement")
        if not fields:
            return self._chain()
        return super().select_related(*fields)


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

    objects = UsageEntryQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "usage entries"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(cached_tokens__lte=models.F("prompt_tokens")),
                name="usage_cached_within_prompt",
            ),
        ]
        indexes = [
            # Statement membership and rating: one tenant's entries over a time range.
            models.Index(fields=["tenant", "created_at"], name="usage_tenant_created"),
            # Late usage: one tenant's entries written after a statement's close watermark.
            models.Index(fields=["tenant", "id"], name="usage_tenant_id"),
        ]

    def __str__(self) -> str:
        return (
            f"{self.request_id}: {self.tenant.name} {self.prompt_tokens}+{self.completion_tokens}"
        )

    # Which statement bills an entry is not stored on the entry (that took an UPDATE of every
    # row of the month): it follows from the tenant's statements (the rule: billing/statements.py).
    @property
    def statement(self) -> Statement | None:
        """The statement that bills this entry, or None while no statement covers it yet."""
        if not hasattr(self, "_statement_cache"):
            self._statement_cache = Statement.objects.billing(self)
        return self._statement_cache

    @property
    def statement_id(self) -> int | None:
        statement = self.statement
        return statement.pk if statement is not None else None


def _price_field(what: str) -> models.DecimalField:
    return models.DecimalField(
        max_digits=12,
        decimal_places=6,
        validators=[MinValueValidator(Decimal("0")), MaxValueValidator(Decimal("1000000"))],
        help_text=f"Price of 1M {what} tokens, in `currency`.",
    )


class ModelPrice(PeriodPrice):
    """What 1M tokens of a served model cost over [effective_from, effective_to).

    With no tenant it is the list price; with a tenant it is that tenant's contract price,
    which wins over the list price wherever one is in force.
    """

    served_model = models.ForeignKey(
        "fleet.ServedModel",
        on_delete=models.PROTECT,
        related_name="prices",
        help_text="The served model this price is for (matched to usage by its name).",
    )
    tenant = models.ForeignKey(
        "billing.Tenant",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="contract_prices",
        help_text="Empty: the list price. Set: this tenant's contract price, which overrides it.",
    )
    input_per_mtok = _price_field("uncached input")
    cached_input_per_mtok = _price_field("cached input")
    output_per_mtok = _price_field("output")
    updated_at = models.DateTimeField(
        auto_now=True, help_text="Last change; open statements are re-rated when the book changes."
    )

    class Meta:
        ordering = ["served_model", "tenant", "effective_from"]
        constraints = [
            *PeriodPrice.Meta.constraints,
            models.CheckConstraint(
                condition=models.Q(input_per_mtok__gte=0)
                & models.Q(cached_input_per_mtok__gte=0)
                & models.Q(output_per_mtok__gte=0),
                name="modelprice_not_negative",
            ),
        ]
        indexes = [models.Index(fields=["served_model", "tenant", "effective_from"])]

    def __str__(self) -> str:
        who = self.tenant.name if self.tenant is not None else "list"
        return (
            f"{self.served_model} ({who}): {self.input_per_mtok}/{self.cached_input_per_mtok}/"
            f"{self.output_per_mtok} {self.currency} per 1M {self.period_text()}"
        )

    def overlapping_prices(self) -> EffectivePeriodQuerySet | None:
        """Prices for the same model and tenant (None: the list)."""
        if not (self.served_model_id and self.effective_from is not None):
            return None
        prices = ModelPrice.objects.filter(served_model_id=self.served_model_id)
        if self.tenant_id is None:
            prices = prices.filter(tenant__isnull=True)
        else:
            prices = prices.filter(tenant_id=self.tenant_id)
        return prices.intersecting(self.effective_from, self.effective_to)

    def clash_message(self, clash: PeriodPrice) -> str:
        whose = "this tenant's contract" if self.tenant_id else "the list"
        return (
            f"Overlaps the existing price #{clash.pk} of {whose} for this model; "
            "end that period first or pick a later start."
        )


class StatementStatus(models.TextChoices):
    OPEN = "open", "Open"
    CLOSED = "closed", "Closed"


class StatementQuerySet(models.QuerySet):
    def billing(self, entry: UsageEntry) -> Statement | None:
        """The statement that bills `entry` (the rule in billing/statements.py), or None: the
        tenant's earliest statement ending after the entry that is open or was closed with the
        entry's id at or under its last one."""
        return (
            self.filter(tenant_id=entry.tenant_id, period_end__gt=entry.created_at)
            .filter(models.Q(status=StatementStatus.OPEN) | models.Q(last_entry_id__gte=entry.pk))
            .order_by("period_start")
            .first()
        )


class Statement(models.Model):
    """A tenant's bill for one calendar month (UTC), [period_start, period_end).

    Open statements are re-rated from their usage; a closed one never changes again. Which
    entries a statement bills follows from the tenant's chain of statements and, once closed,
    ``last_entry_id`` (billing/statements.py). Usage that reaches the ledger after its
    month's statement closed is billed on the tenant's next open statement, as adjustment
    lines.
    """

    tenant = models.ForeignKey(
        "billing.Tenant",
        on_delete=models.PROTECT,
        related_name="statements",
        help_text="Who is billed.",
    )
    period_start = models.DateTimeField(help_text="Start of the period (inclusive, UTC).")
    period_end = models.DateTimeField(help_text="End of the period (exclusive, UTC).")
    status = models.CharField(
        max_length=8,
        choices=StatementStatus.choices,
        default=StatementStatus.OPEN,
        help_text="open: still re-rated as usage arrives; closed: final, never changes.",
    )
    rated_at = models.DateTimeField(
        null=True, blank=True, help_text="When the lines were last worked out."
    )
    closed_at = models.DateTimeField(null=True, blank=True, help_text="When it was closed.")
    last_entry_id = models.BigIntegerField(
        null=True,
        blank=True,
        editable=False,
        help_text=(
            "Set when closed: the ledger's highest entry id at the close. The statement bills "
            "entries up to it; one of its period written later is late usage, billed on the "
            "tenant's next open statement."
        ),
    )
    entry_count = models.PositiveBigIntegerField(
        default=0,
        editable=False,
        help_text="How many entries the lines count (at the last rating).",
    )
    price_book = models.CharField(
        max_length=96,
        blank=True,
        editable=False,
        help_text="Version of the price book at the last rating (re-rated when it changes).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = StatementQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__name", "-period_start"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "period_start"], name="statement_one_per_tenant_period"
            ),
            models.CheckConstraint(
                condition=models.Q(period_end__gt=models.F("period_start")),
                name="statement_period_not_empty",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.name} {self.period_start:%Y-%m} ({self.status})"


class StatementLine(models.Model):
    """Usage of one model at one price on a statement: tokens, unit prices, rounded amount."""

    statement = models.ForeignKey(
        "billing.Statement", on_delete=models.CASCADE, related_name="lines"
    )
    model = models.CharField(max_length=128, help_text="Served model name.")
    price = models.ForeignKey(
        "billing.ModelPrice",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="statement_lines",
        help_text="The price the usage was rated with; empty: no price was in force.",
    )
    contract = models.BooleanField(
        default=False, help_text="Rated with the tenant's contract price (not the list)."
    )
    adjustment = models.BooleanField(
        default=False,
        help_text="Late usage from an earlier, already closed period.",
    )
    requests = models.PositiveBigIntegerField()
    input_tokens = models.PositiveBigIntegerField(help_text="Uncached input tokens.")
    cached_tokens = models.PositiveBigIntegerField(help_text="Cached input tokens.")
    output_tokens = models.PositiveBigIntegerField(help_text="Output tokens.")
    currency = models.CharField(max_length=3, blank=True, help_text="Empty when unpriced.")
    input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, null=True)
    cached_input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, null=True)
    output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6, null=True)
    amount = models.DecimalField(
        max_digits=18,
        decimal_places=2,
        help_text="The three components at full precision, summed, rounded half-even.",
    )

    class Meta:
        ordering = ["statement", "adjustment", "model", "id"]

    def __str__(self) -> str:
        return f"{self.statement}: {self.model} {self.amount} {self.currency}"

    # The components at full precision, from the tokens and the unit prices on the line.
    @property
    def input_amount(self) -> Decimal:
        return component(self.input_tokens, self.input_per_mtok)

    @property
    def cached_amount(self) -> Decimal:
        return component(self.cached_tokens, self.cached_input_per_mtok)

    @property
    def output_amount(self) -> Decimal:
        return component(self.output_tokens, self.output_per_mtok)


class DeletedInstanceRun(models.Model):
    """A running interval of a fleet instance that has since been deleted.

    The provider cost (billing/costs.py) comes from instances' state events; deleting an
    instance unlinks its events (``FleetEvent.instance`` is SET_NULL), so just before an
    instance is deleted its running intervals are copied here with what prices them (GPU
    type and datacenter) and what the reports group by (model, names, GPU count)."""

    instance_id = models.BigIntegerField(db_index=True, help_text="The deleted instance's id.")
    model = models.CharField(max_length=128, help_text="Served model name.")
    datacenter = models.CharField(max_length=64, help_text="Datacenter name.")
    datacenter_ref = models.BigIntegerField(help_text="Datacenter id (to match unit prices).")
    gpu_type = models.CharField(max_length=128, help_text="GPU type (model name).")
    gpu_type_ref = models.BigIntegerField(help_text="GPU type id (to match unit prices).")
    gpu_count = models.PositiveIntegerField()
    started_at = models.DateTimeField(help_text="Start of the running interval.")
    ended_at = models.DateTimeField(help_text="End (the deletion, if it was still running).")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["started_at", "instance_id"]
        indexes = [models.Index(fields=["started_at", "ended_at"], name="deletedrun_span")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(ended_at__gt=models.F("started_at")),
                name="deletedrun_not_empty",
            ),
        ]

    def __str__(self) -> str:
        return f"instance {self.instance_id} ({self.model}) {self.started_at} - {self.ended_at}"
