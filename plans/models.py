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


class SizingRun(models.Model):
    """One ``planner size`` question: the cheapest fleet meeting an SLA at a rate, and the
    best-BCR fleet, searched from a starting fleet (the scenario's, or the database's)."""

    status = models.CharField(
        max_length=16,
        choices=PlanRunStatus.choices,
        default=PlanRunStatus.QUEUED,
        help_text="queued, running, done or failed; only a queued run may start.",
    )
    scenario = models.CharField(
        max_length=64,
        help_text="Bundled planner scenario: model, engine, workload, SLA, policy and, unless "
        "start_from_db, the starting fleet.",
    )
    rps = models.FloatField(
        null=True,
        blank=True,
        help_text="Target rate, requests/s (empty: the scenario's).",
    )
    p90 = models.FloatField(
        null=True,
        blank=True,
        help_text="SLA: P90 TTFT below this many seconds (empty: the scenario's).",
    )
    p99 = models.FloatField(
        null=True,
        blank=True,
        help_text="SLA: P99 TTFT below this many seconds (empty: the scenario's).",
    )
    # Not ``from_db``: that name is Model.from_db, the classmethod that loads rows.
    start_from_db = models.BooleanField(
        default=False,
        help_text="Start from the fleet in the database (GPU types, prices and WAN link from "
        "the inventory, counts = nodes now running each role) instead of the scenario's.",
    )
    inputs = models.JSONField(
        default=dict,
        blank=True,
        help_text="What the search is given: the starting fleet (from the database at creation, "
        "or none: the scenario's), rate, SLA overrides and notes.",
    )
    result = models.JSONField(
        default=dict,
        blank=True,
        help_text="planner.size's answer: cheapest fleet (with one_fewer, binding pools and "
        "band), max-BCR fleet and candidates, unit prices, runs, wall seconds.",
    )
    error = models.TextField(blank=True, help_text="Why the run failed, if it did.")
    progress_done = models.PositiveIntegerField(default=0, help_text="Simulations done so far.")
    progress_total = models.PositiveIntegerField(
        default=0,
        help_text="Simulations asked for so far (the search adds them as it goes).",
    )
    progress_note = models.CharField(
        max_length=200, blank=True, help_text="What the search is doing now."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="sizing_runs",
        help_text="Who asked.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "sizing run"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(progress_done__lte=models.F("progress_total")),
                name="sizingrun_progress_within_total",
            ),
        ]

    def __str__(self) -> str:
        return f"sizing #{self.pk} {self.scenario} ({self.status})"
