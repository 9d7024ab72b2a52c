"""Named constants for fleet states and roles, stored as strings."""

from __future__ import annotations

from django.db import models

from pdd.vocab import LinkStatus as Link
from pdd.vocab import Role


class InstanceRole(models.TextChoices):
    PREFILL = Role.PREFILL, "Prefill (P)"
    RELAY_DECODE = Role.RELAY_DECODE, "Relay decode (RLD)"
    MAIN_DECODE = Role.MAIN_DECODE, "Main decode (MD)"


class DesiredState(models.TextChoices):
    RUNNING = "running", "Running"
    DRAINED = "drained", "Drained"
    STOPPED = "stopped", "Stopped"


class ActualState(models.TextChoices):
    PENDING = "pending", "Pending"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    DRAINING = "draining", "Draining"
    DRAINED = "drained", "Drained"
    STOPPED = "stopped", "Stopped"
    UNAVAILABLE = "unavailable", "Unavailable"
    FAILED = "failed", "Failed"


class NodeStatus(models.TextChoices):
    PENDING = "pending", "Pending registration"
    ONLINE = "online", "Online"
    OFFLINE = "offline", "Offline"
    MAINTENANCE = "maintenance", "Maintenance"


class LinkStatus(models.TextChoices):
    UP = Link.UP, "Up"
    DEGRADED = Link.DEGRADED, "Degraded"
    DOWN = Link.DOWN, "Down"


class Currency(models.TextChoices):
    USD = "USD", "US dollar"
    EUR = "EUR", "Euro"
    CNY = "CNY", "Chinese yuan"


class PlanRunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
