"""Datacenters: the sites that hold nodes; one RDMA domain each by default."""

from __future__ import annotations

from django.db import models

from fleet.validators import slug_name


class Datacenter(models.Model):
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[slug_name],
        help_text="Short unique name, e.g. 'dc-a'.",
    )
    region = models.CharField(
        max_length=64,
        help_text="Geographic region or city, e.g. 'shanghai'.",
    )
    rdma_domain = models.CharField(
        max_length=64,
        blank=True,
        help_text=(
            "Fast-fabric (RDMA) domain. Instances in the same domain exchange KV over the "
            "intra-datacenter fabric; defaults to the datacenter's name."
        ),
    )
    description = models.TextField(
        blank=True,
        help_text="Free text for operators.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.region})"

    def save(self, *args, **kwargs) -> None:
        if not self.rdma_domain:
            self.rdma_domain = self.name
        super().save(*args, **kwargs)
