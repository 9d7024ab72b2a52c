"""Named constants for fleet states and roles, stored as strings."""

from __future__ import annotations

from django.db import models


class InstanceRole(models.TextChoices):
    PREFILL = "prefill", "Prefill (P)"
    RELAY_DECODE = "relay_decode", "Relay decode (RLD)"
    MAIN_DECODE = "main_decode", "Main decode (MD)"


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
    UP = "up", "Up"
    DEGRADED = "degraded", "Degraded"
    DOWN = "down", "Down"


class Currency(models.TextChoices):
    USD = "USD", "US dollar"
    EUR = "EUR", "Euro"
    CNY = "CNY", "Chinese yuan"


class PlanRunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
