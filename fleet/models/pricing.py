"""Unit prices: what one GPU-hour of a GPU type costs in a datacenter over a period."""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator
from django.db import models

from fleet.choices import Currency
from fleet.validators import GreaterThanValidator


class EffectivePeriodQuerySet(models.QuerySet):
    """Rows in force over [effective_from, effective_to) (an empty end: open-ended), as unit
    prices and the billing price book both are."""

    def intersecting(self, effective_from, effective_to):
        """Rows whose period intersects [effective_from, effective_to)."""
        qs = self
        if effective_to is not None:
            qs = qs.filter(effective_from__lt=effective_to)
        return qs.filter(
            models.Q(effective_to__isnull=True) | models.Q(effective_to__gt=effective_from)
        )

    def effective_at(self, when):
        return self.filter(effective_from__lte=when).filter(
            models.Q(effective_to__isnull=True) | models.Q(effective_to__gt=when)
        )


def check_effective_period(row, overlapping: models.QuerySet | None, clash_message) -> None:
    """A period row's clean(): its end after its start, and no other row of `overlapping`
    (the rows that must not share any instant with it) in force at the same time;
    `clash_message(clash)` says which row it overlaps and what to do."""
    if (
        row.effective_to is not None
        and row.effective_from is not None
        and row.effective_to <= row.effective_from
    ):
        raise ValidationError({"effective_to": "Must be later than effective_from."})
    if overlapping is None:
        return
    clash = overlapping.exclude(pk=row.pk).first()
    if clash is not None:
        raise ValidationError({"effective_from": clash_message(clash)})


class UnitPriceQuerySet(EffectivePeriodQuerySet):
    def overlapping(self, *, gpu_type_id, datacenter_id, effective_from, effective_to):
        """Prices for the same pair whose effective range intersects [from, to)."""
        return self.filter(gpu_type_id=gpu_type_id, datacenter_id=datacenter_id).intersecting(
            effective_from, effective_to
        )


class UnitPrice(models.Model):
    gpu_type = models.ForeignKey(
        "fleet.GPUType",
        on_delete=models.PROTECT,
        related_name="unit_prices",
        help_text="The GPU type this price is for.",
    )
    datacenter = models.ForeignKey(
        "fleet.Datacenter",
        on_delete=models.PROTECT,
        related_name="unit_prices",
        help_text="The datacenter where this price applies.",
    )
    price_per_gpu_hour = models.DecimalField(
        max_digits=12,
        decimal_places=4,
        validators=[GreaterThanValidator(Decimal("0")), MaxValueValidator(Decimal("100000"))],
        help_text="Price of one GPU for one hour, in `currency`.",
    )
    currency = models.CharField(
        max_length=3,
        choices=Currency.choices,
        default=Currency.USD,
        help_text="ISO 4217 currency code.",
    )
    effective_from = models.DateTimeField(
        help_text="Start of the period (inclusive).",
    )
    effective_to = models.DateTimeField(
        null=True,
        blank=True,
        help_text="End of the period (exclusive); empty means open-ended.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = UnitPriceQuerySet.as_manager()

    class Meta:
        ordering = ["gpu_type", "datacenter", "effective_from"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(effective_to__isnull=True)
                | models.Q(effective_to__gt=models.F("effective_from")),
                name="unitprice_range_not_empty",
            ),
            models.CheckConstraint(
                condition=models.Q(price_per_gpu_hour__gt=0),
                name="unitprice_positive",
            ),
        ]

    def __str__(self) -> str:
        until = self.effective_to.date().isoformat() if self.effective_to else "open"
        return (
            f"{self.gpu_type} @ {self.datacenter.name}: {self.price_per_gpu_hour} "
            f"{self.currency}/GPU-h from {self.effective_from.date().isoformat()} to {until}"
        )

    def clean(self) -> None:
        super().clean()
        check_effective_period(
            self,
            UnitPrice.objects.overlapping(
                gpu_type_id=self.gpu_type_id,
                datacenter_id=self.datacenter_id,
                effective_from=self.effective_from,
                effective_to=self.effective_to,
            )
            if self.gpu_type_id and self.datacenter_id and self.effective_from is not None
            else None,
            lambda clash: (
                f"Overlaps the existing price #{clash.pk} for this GPU type and "
                "datacenter; end that period first or pick a later start."
            ),
        )
