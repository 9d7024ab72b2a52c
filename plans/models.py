"""Capacity-plan runs: one search of P / RLD / MD node counts, its inputs and its best results."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from fleet.choices import PlanRunStatus


class PlanRun(models.Model):
    status = models.CharField(
        max_length=16,
        choices=PlanRunStatus.choices,
        default=PlanRunStatus.QUEUED,
        help_text="queued, running, done or failed; only a queued run may start.",
    )
    scenario = models.CharField(
        max_length=64,
        help_text="Bundled planner scenario the model, engine, workload, SLA and policy come from.",
    )
    top = models.PositiveSmallIntegerField(
        default=5,
        validators=[MinValueValidator(1), MaxValueValidator(20)],
        help_text="How many of the best configurations to keep.",
    )
    inputs = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            "What the planner is given: fleet spec (per-node units and prices from the database "
            "at creation), workload, SLA, search space, the requested counts and notes."
        ),
    )
    results = models.JSONField(
        default=list,
        blank=True,
        help_text="Best configurations, best BCR first: counts, goodput req/s, cost/h, BCR.",
    )
    error = models.TextField(
        blank=True,
        help_text="Why the run failed, if it did.",
    )
    progress_done = models.PositiveIntegerField(
        default=0,
        help_text="Configurations simulated so far.",
    )
    progress_total = models.PositiveIntegerField(
        default=0,
        help_text="Configurations in the search.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="plan_runs",
        help_text="Who asked for the plan.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a worker started the search.",
    )
    finished_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the search finished or failed.",
    )

    class Meta:
        # The table of the days when plan runs lived in ``fleet``: moving the model kept its rows.
        db_table = "fleet_planrun"
        ordering = ["-created_at", "-id"]
        verbose_name = "plan run"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(progress_done__lte=models.F("progress_total")),
                name="planrun_progress_within_total",
            ),
        ]

    def __str__(self) -> str:
        return f"plan #{self.pk} {self.scenario} ({self.status})"
