"""Named constants for fleet states and roles, stored as strings."""

from __future__ import annotations

from django.db import models

from pdd.vocab import InstanceStatus, Role
from pdd.vocab import LinkStatus as Link


class InstanceRole(models.TextChoices):
    PREFILL = Role.PREFILL, "Prefill (P)"
    RELAY_DECODE = Role.RELAY_DECODE, "Relay decode (RLD)"
    MAIN_DECODE = Role.MAIN_DECODE, "Main decode (MD)"


class DesiredState(models.TextChoices):
    RUNNING = "running", "Running"
    DRAINED = "drained", "Drained"
    STOPPED = "stopped", "Stopped"


class ActualState(models.TextChoices):
    """An instance's state as the control plane last knew it: what its agent reports
    (``pdd.vocab.InstanceStatus``) and the control plane's own pending and unavailable."""

    PENDING = "pending", "Pending"
    STARTING = InstanceStatus.STARTING, "Starting"
    RUNNING = InstanceStatus.RUNNING, "Running"
    DRAINING = InstanceStatus.DRAINING, "Draining"
    DRAINED = InstanceStatus.DRAINED, "Drained"
    STOPPED = InstanceStatus.STOPPED, "Stopped"
    UNAVAILABLE = "unavailable", "Unavailable"
    FAILED = InstanceStatus.FAILED, "Failed"


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
