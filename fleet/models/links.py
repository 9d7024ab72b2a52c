"""WAN links between datacenters: the slow path KV deltas and handoffs cross."""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from fleet.choices import LinkStatus
from fleet.validators import GreaterThanValidator
from pdd.kv_formats import KV_FORMATS as FORMATS

# The KV transport formats a link may ask for (pdd/kv_formats.py).
_LABELS = {"int8": "8-bit, per-block scales (lossy)"}
KV_FORMATS = [("", "the engine's own (lossless)")] + [(f, _LABELS.get(f, f)) for f in FORMATS]


class WANLink(models.Model):
    from_datacenter = models.ForeignKey(
        "fleet.Datacenter",
        on_delete=models.PROTECT,
        related_name="links_out",
        help_text="Datacenter at the sending end (where prefill runs).",
    )
    to_datacenter = models.ForeignKey(
        "fleet.Datacenter",
        on_delete=models.PROTECT,
        related_name="links_in",
        help_text="Datacenter at the receiving end (where main decode runs).",
    )
    bandwidth_gbps = models.FloatField(
        validators=[GreaterThanValidator(0), MaxValueValidator(100_000)],
        help_text="Line bandwidth, Gbit/s.",
    )
    rtt_ms = models.FloatField(
        validators=[MinValueValidator(0), MaxValueValidator(10_000)],
        help_text="Round-trip time, milliseconds.",
    )
    connection_pool_size = models.PositiveIntegerField(
        default=16,
        validators=[MinValueValidator(1), MaxValueValidator(10_000)],
        help_text="Concurrent KV transfers allowed on the link; more wait for a connection.",
    )
    monthly_cost = models.DecimalField(
        max_digits=14,
        decimal_places=2,
        default=Decimal("0"),
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Cost of the line per month, in `currency`.",
    )
    currency = models.CharField(
        max_length=3,
        default="USD",
        help_text="ISO 4217 currency code of monthly_cost.",
    )
    status = models.CharField(
        max_length=16,
        choices=LinkStatus.choices,
        default=LinkStatus.UP,
        help_text="Operational status: up, degraded or down.",
    )
    kv_format = models.CharField(
        max_length=16,
        choices=KV_FORMATS,
        blank=True,
        default="",
        help_text="Format of the KV P sends across this link: empty for the engine's own "
        "(lossless), a float dtype, or int8 (8-bit with per-block scales, lossy; docs/agents.md).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["from_datacenter__name", "to_datacenter__name"]
        verbose_name = "WAN link"
        constraints = [
            models.UniqueConstraint(
                fields=["from_datacenter", "to_datacenter"],
                name="wanlink_unique_pair",
            ),
            models.CheckConstraint(
                condition=~models.Q(from_datacenter=models.F("to_datacenter")),
                name="wanlink_distinct_ends",
            ),
            models.CheckConstraint(condition=models.Q(bandwidth_gbps__gt=0), name="wanlink_bw_gt0"),
            models.CheckConstraint(condition=models.Q(rtt_ms__gte=0), name="wanlink_rtt_gte0"),
        ]

    def __str__(self) -> str:
        return (
            f"{self.from_datacenter.name} -> {self.to_datacenter.name} "
            f"({self.bandwidth_gbps:g} Gbit/s, {self.rtt_ms:g} ms, {self.status})"
        )

    def clean(self) -> None:
        super().clean()
        if self.from_datacenter_id and self.from_datacenter_id == self.to_datacenter_id:
            raise ValidationError(
                {"to_datacenter": "A WAN link must join two different datacenters."}
            )
