"""GPU types, described by the four numbers that decide prefill and decode speed."""

from __future__ import annotations

from django.core.validators import MaxValueValidator
from django.db import models

from fleet.validators import GreaterThanValidator


class GPUType(models.Model):
    vendor = models.CharField(
        max_length=64,
        help_text="Chip vendor, e.g. 'nvidia'.",
    )
    model = models.CharField(
        max_length=64,
        help_text="Chip model, e.g. 'h800'.",
    )
    peak_bf16_tflops = models.FloatField(
        validators=[GreaterThanValidator(0), MaxValueValidator(100_000)],
        help_text="Peak dense BF16 compute, TFLOP/s.",
    )
    memory_gib = models.FloatField(
        validators=[GreaterThanValidator(0), MaxValueValidator(100_000)],
        help_text="Device memory capacity, GiB.",
    )
    memory_bandwidth_gbps = models.FloatField(
        validators=[GreaterThanValidator(0), MaxValueValidator(1_000_000)],
        help_text="Device memory bandwidth, GB/s.",
    )
    interconnect_gbps = models.FloatField(
        validators=[GreaterThanValidator(0), MaxValueValidator(1_000_000)],
        help_text="Scale-up interconnect bandwidth per GPU, GB/s.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["vendor", "model"]
        verbose_name = "GPU type"
        constraints = [
            models.UniqueConstraint(fields=["vendor", "model"], name="gputype_unique_vendor_model"),
            models.CheckConstraint(
                condition=models.Q(peak_bf16_tflops__gt=0)
                & models.Q(memory_gib__gt=0)
                & models.Q(memory_bandwidth_gbps__gt=0)
                & models.Q(interconnect_gbps__gt=0),
                name="gputype_numbers_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.vendor} {self.model}"
