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


class ProposalStatus(models.TextChoices):
    """A proposal's life: sized (``sizing``), then ``proposed``; an operator (or the automatic
    mode) approves or rejects it; an approved one is ``applying`` until every step is done
    (``applied``) or one failed (``failed``). ``stale``: the fleet changed before it was
    approved; ``unchanged``: the running fleet already is the answer (nothing to apply)."""

    SIZING = "sizing", "Sizing"
    PROPOSED = "proposed", "Proposed"
    UNCHANGED = "unchanged", "Unchanged"
    APPROVED = "approved", "Approved"
    APPLYING = "applying", "Applying"
    APPLIED = "applied", "Applied"
    REJECTED = "rejected", "Rejected"
    STALE = "stale", "Stale"
    FAILED = "failed", "Failed"


class AutopilotSettings(models.Model):
    """The autopilot's one row of settings: the schedule, the SLA it sizes for, and the
    guardrails of the automatic mode (an operator's approval applies any proposal)."""

    automatic = models.BooleanField(
        default=False,
        help_text="Apply proposals without an operator's approval, within the guardrails below.",
    )
    served_model = models.ForeignKey(
        "fleet.ServedModel",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="The served model whose fleet the autopilot sizes (empty: the one with the "
        "most instances).",
    )
    scenario = models.CharField(
        max_length=64,
        default="tiny-size",
        help_text="Bundled planner scenario for the model, engine and policy the planner "
        "simulates; the workload comes from the live profile.",
    )
    interval_s = models.PositiveIntegerField(
        default=300,
        validators=[MinValueValidator(0), MaxValueValidator(86_400)],
        help_text="Make a proposal every this many seconds (0: only on demand).",
    )
    window_s = models.PositiveIntegerField(
        default=900,
        validators=[MinValueValidator(60), MaxValueValidator(86_400)],
        help_text="The live profile reads the request records of this many seconds.",
    )
    p90 = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001), MaxValueValidator(3_600)],
        help_text="SLA: P90 TTFT below this many seconds (empty: the scenario's).",
    )
    p99 = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.001), MaxValueValidator(3_600)],
        help_text="SLA: P99 TTFT below this many seconds (empty: the scenario's).",
    )
    max_change_per_step = models.PositiveIntegerField(
        default=4,
        validators=[MinValueValidator(1), MaxValueValidator(1_000)],
        help_text="Automatic mode: at most this many instances started or drained per apply; "
        "a larger proposal is applied in steps.",
    )
    cooldown_s = models.PositiveIntegerField(
        default=300,
        validators=[MaxValueValidator(86_400)],
        help_text="Automatic mode: no apply within this many seconds of the last one's end.",
    )
    scale_down_after_s = models.PositiveIntegerField(
        default=300,
        validators=[MaxValueValidator(86_400)],
        help_text="Automatic mode: a proposal that shrinks a role waits until no proposal of "
        "this many seconds before it wanted more of that role, and never applies while the "
        "fleet misses the SLA.",
    )
    budget_per_hour = models.DecimalField(
        max_digits=12,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Automatic mode: never apply a fleet costing more than this per hour "
        "(empty: no cap).",
    )
    floors = models.JSONField(
        default=dict,
        blank=True,
        help_text='Fewest nodes per role, e.g. {"prefill": 1, "main_decode": 1, '
        '"relay_decode": 0}; every proposal keeps at least these.',
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "autopilot settings"
        verbose_name_plural = "autopilot settings"

    def __str__(self) -> str:
        return f"autopilot ({'automatic' if self.automatic else 'approval'})"


class Proposal(models.Model):
    """One answer of the autopilot: the fleet the planner sizes for the live profile, the
    changes from the running fleet, the predicted figures before and after, and, once applied,
    the realised ones."""

    status = models.CharField(
        max_length=16, choices=ProposalStatus.choices, default=ProposalStatus.SIZING
    )
    trigger = models.CharField(
        max_length=16,
        default="manual",
        help_text="manual (asked for) or schedule (the autopilot's period).",
    )
    scenario = models.CharField(max_length=64)
    model = models.CharField(max_length=128, blank=True, help_text="The served model sized.")
    profile = models.JSONField(default=dict, blank=True, help_text="The live workload profile.")
    fingerprint = models.CharField(
        max_length=64,
        help_text="The fleet it was made for (instances, their nodes and desired states, nodes "
        "online); a proposal whose fleet changed is stale.",
    )
    current = models.JSONField(
        default=dict, blank=True, help_text="Running nodes per pool and their cost per hour."
    )
    target = models.JSONField(
        default=dict, blank=True, help_text="Proposed nodes per pool and their cost per hour."
    )
    changes = models.JSONField(
        default=list, blank=True, help_text="Planned steps: start / drain, role, node, why."
    )
    predicted = models.JSONField(
        default=dict,
        blank=True,
        help_text="Simulated figures of the running and the proposed fleet at the profile's "
        "rate: P90/P99 TTFT, goodput, cost per hour, BCR.",
    )
    thresholds = models.JSONField(
        default=dict, blank=True, help_text="Routing thresholds the simulator finds best."
    )
    sizing = models.JSONField(default=dict, blank=True, help_text="planner.size's answer.")
    guardrails = models.JSONField(
        default=list, blank=True, help_text="Why the automatic mode would not apply it now."
    )
    reason = models.TextField(blank=True, help_text="The proposal in words.")
    error = models.TextField(blank=True)
    decided_by = models.CharField(max_length=150, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    applied_at = models.DateTimeField(null=True, blank=True)
    realised = models.JSONField(
        default=list,
        blank=True,
        help_text="After apply: the realised figures per window beside the predicted ones.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"proposal #{self.pk} ({self.status})"


class StepStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"  # its side effect is done; waiting for the fleet
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
    SKIPPED = "skipped", "Skipped"  # nothing left to do (its instance was already gone)


class ProposalStep(models.Model):
    """One change of an approved proposal, carried out by Celery (idempotent, resumable)."""

    PENDING, RUNNING, DONE = StepStatus.PENDING, StepStatus.RUNNING, StepStatus.DONE
    FAILED, SKIPPED = StepStatus.FAILED, StepStatus.SKIPPED

    proposal = models.ForeignKey(Proposal, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveIntegerField()
    action = models.CharField(max_length=8, help_text="start or drain.")
    role = models.CharField(max_length=16)
    node = models.ForeignKey(
        "fleet.Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    instance_id_ref = models.PositiveIntegerField(
        null=True, blank=True, help_text="The instance started, or the one drained."
    )
    status = models.CharField(max_length=8, choices=StepStatus.choices, default=StepStatus.PENDING)
    note = models.CharField(max_length=300, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["proposal", "index"]
        constraints = [
            models.UniqueConstraint(fields=["proposal", "index"], name="proposalstep_unique_index")
        ]

    def __str__(self) -> str:
        return f"step {self.index} of proposal {self.proposal_id}: {self.action} {self.role}"
