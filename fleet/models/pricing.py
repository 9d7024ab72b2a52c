"""Prices over a period: the shape every price table has (PeriodPrice, which billing's price
book shares), and the fleet's unit prices, what one GPU-hour of a GPU type costs in a
datacenter."""

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


class PeriodPrice(models.Model):
    """A price in force over [effective_from, effective_to), in one currency: the shape of the
    fleet's unit prices and of billing's price book. clean() checks that the period ends after
    it starts and that no row of ``overlapping_prices()`` is in force at the same instant."""

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

    objects = EffectivePeriodQuerySet.as_manager()

    class Meta:
        abstract = True
        # A subclass lists these first in its own Meta.constraints.
        constraints = [
            models.CheckConstraint(
                condition=models.Q(effective_to__isnull=True)
                | models.Q(effective_to__gt=models.F("effective_from")),
                name="%(class)s_range_not_empty",
            ),
        ]

    def overlapping_prices(self) -> EffectivePeriodQuerySet | None:
        """The rows that must not share an instant with this one, or None while the row lacks
        what picks them."""
        raise NotImplementedError

    def clash_message(self, clash: PeriodPrice) -> str:
        """What clean() says when this row overlaps ``clash``, and what to do."""
        raise NotImplementedError

    def clean(self) -> None:
        super().clean()
        if (
            self.effective_to is not None
            and self.effective_from is not None
            and self.effective_to <= self.effective_from
        ):
            raise ValidationError({"effective_to": "Must be later than effective_from."})
        overlapping = self.overlapping_prices()
        if overlapping is None:
            return
        clash = overlapping.exclude(pk=self.pk).first()
        if clash is not None:
            raise ValidationError({"effective_from": self.clash_message(clash)})

    def period_text(self) -> str:
        until = self.effective_to.date().isoformat() if self.effective_to else "open"
        return f"from {self.effective_from.date().isoformat()} to {until}"


class UnitPrice(PeriodPrice):
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

    class Meta:
        ordering = ["gpu_type", "datacenter", "effective_from"]
        constraints = [
            *PeriodPrice.Meta.constraints,
            models.CheckConstraint(
                condition=models.Q(price_per_gpu_hour__gt=0),
                name="unitprice_positive",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.gpu_type} @ {self.datacenter.name}: {self.price_per_gpu_hour} "
            f"{self.currency}/GPU-h {self.period_text()}"
        )

    def overlapping_prices(self) -> EffectivePeriodQuerySet | None:
        """Prices for the same GPU type and datacenter."""
        if not (self.gpu_type_id and self.datacenter_id and self.effective_from is not None):
            return None
        return UnitPrice.objects.filter(
            gpu_type_id=self.gpu_type_id, datacenter_id=self.datacenter_id
        ).intersecting(self.effective_from, self.effective_to)

    def clash_message(self, clash: PeriodPrice) -> str:
        return (
            f"Overlaps the existing price #{clash.pk} for this GPU type and "
            "datacenter; end that period first or pick a later start."
        )
