"""Stored string values of routing records; the values are the policy module's own."""

from __future__ import annotations

from django.db import models

from pdd.vocab import HandoffMode, Pipeline


class PipelineChoice(models.TextChoices):
    P_MD = Pipeline.P_MD, "P-MD"
    P_RLD_MD = Pipeline.P_RLD_MD, "P-RLD-MD"
    RLD_ONLY = Pipeline.RLD_ONLY, "RLD only (singular traffic or fallback)"
    SINGLE = "single", "Single engine"


class HandoffChoice(models.TextChoices):
    ONE_SHOT = HandoffMode.ONE_SHOT, "One-shot"
    CATCH_UP = HandoffMode.CATCH_UP, "Catch-up"
    NONE = HandoffMode.NONE, "None"


class RequestStatus(models.TextChoices):
    OK = "ok", "Completed"
    CANCELLED = "cancelled", "Cancelled by the client"
    ERROR = "error", "Failed"
    REJECTED = "rejected", "Rejected before running"
    INTERRUPTED = "interrupted", "Interrupted: the gateway process died while it ran"
