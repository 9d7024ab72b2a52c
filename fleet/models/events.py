"""Event history of nodes and instances: state changes, operator actions, errors."""

from __future__ import annotations

from django.db import models


class FleetEvent(models.Model):
    node = models.ForeignKey(
        "fleet.Node",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="events",
        help_text="Node the event concerns, if any.",
    )
    instance = models.ForeignKey(
        "fleet.Instance",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="events",
        help_text="Instance the event concerns, if any.",
    )
    kind = models.CharField(
        max_length=64,
        help_text="Machine-readable kind, e.g. 'instance.created', 'node.token_rotated'.",
    )
    message = models.TextField(
        help_text="What happened, for people.",
    )
    data = models.JSONField(
        default=dict,
        blank=True,
        help_text="Details (previous and new values, error text).",
    )
    actor = models.CharField(
        max_length=150,
        blank=True,
        help_text="Who caused it: a username, 'agent', 'reconcile'.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind}: {self.message}"
