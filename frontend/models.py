"""Settings of the telemetry the operator can change: the goodput SLA of each served model."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

from fleet.validators import GreaterThanValidator


class ServedModelSLA(models.Model):
    """Goodput SLA of one served model; models without a row use P90 < 10 s, P99 < 15 s."""

    model_name = models.CharField(
        max_length=128,
        unique=True,
        help_text="Served model name as it appears on request records, e.g. 'baton-tiny'.",
    )
    p90_ttft_s = models.FloatField(
        default=10.0,
        validators=[GreaterThanValidator(0)],
        help_text="P90 time to first token must stay below this, seconds.",
    )
    p99_ttft_s = models.FloatField(
        default=15.0,
        validators=[GreaterThanValidator(0)],
        help_text="P99 time to first token must stay below this, seconds.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_name"]
        verbose_name = "served model SLA"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(p90_ttft_s__gt=0)
                & models.Q(p99_ttft_s__gte=models.F("p90_ttft_s")),
                name="servedmodelsla_bounds_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model_name}: P90 TTFT < {self.p90_ttft_s:g} s, P99 < {self.p99_ttft_s:g} s"

    def clean(self) -> None:
        super().clean()
        if self.p90_ttft_s and self.p99_ttft_s and self.p99_ttft_s < self.p90_ttft_s:
            raise ValidationError({"p99_ttft_s": "Must be at least the P90 bound."})
