"""Nodes (GPU servers running one agent each) and the engine instances placed on them."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from base.tokens import HashedToken, digest_field, prefix_field
from fleet.choices import ActualState, DesiredState, InstanceRole, NodeStatus
from fleet.endpoints import check_agent_endpoint
from fleet.validators import hostname


class Node(HashedToken):
    # Its agent's token, bnt_<12 hex>_<secret>, kept as a prefix and a digest under the names
    # the API has always shown (base/tokens.py).
    PREFIX_FIELD = "agent_token_prefix"
    DIGEST_FIELD = "agent_token_hash"
    scheme = "bnt"
    separator = "_"
    prefix_bytes = 6

    hostname = models.CharField(
        max_length=253,
        unique=True,
        validators=[hostname],
        help_text="The server's hostname, unique in the fleet.",
    )
    datacenter = models.ForeignKey(
        "fleet.Datacenter",
        on_delete=models.PROTECT,
        related_name="nodes",
        help_text="Datacenter the server sits in.",
    )
    gpu_type = models.ForeignKey(
        "fleet.GPUType",
        on_delete=models.PROTECT,
        related_name="nodes",
        help_text="The GPU type installed (one type per node).",
    )
    gpu_count = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(1024)],
        help_text="Number of GPUs in the server.",
    )
    agent_endpoint = models.URLField(
        max_length=512,
        blank=True,
        help_text="Base URL of the node agent's HTTP API, e.g. http://10.0.0.5:9000.",
    )
    status = models.CharField(
        max_length=16,
        choices=NodeStatus.choices,
        default=NodeStatus.PENDING,
        help_text="pending until the agent registers, then online / offline / maintenance.",
    )
    last_heartbeat_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the agent last reported in.",
    )
    agent_token_prefix = prefix_field(
        "Public prefix of the agent token, to find the node; not a secret."
    )
    agent_token_hash = digest_field(
        "SHA-256 of the agent token; the token itself is shown once and never stored."
    )
    command_token = models.CharField(
        max_length=64,
        blank=True,
        editable=False,
        help_text=(
            "Secret the control plane presents when it commands the agent; issued afresh at "
            "each registration. Never exposed by the API."
        ),
    )
    registered_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the agent last registered.",
    )
    last_report = models.JSONField(
        default=dict,
        blank=True,
        help_text="The agent's latest state document (load, KV usage, cache, fabric bytes).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["datacenter__name", "hostname"]

    def __str__(self) -> str:
        return f"{self.hostname} ({self.gpu_count}x {self.gpu_type.model}, {self.datacenter.name})"

    @classmethod
    def from_db(cls, db, field_names, values):
        node = super().from_db(db, field_names, values)
        # clean() checks the endpoint only when it changes: editing another field of a node
        # whose name does not resolve this minute should not fail on that.
        node._loaded_agent_endpoint = node.__dict__.get("agent_endpoint")
        return node

    def clean(self) -> None:
        super().clean()
        if self.agent_endpoint and self.agent_endpoint != getattr(
            self, "_loaded_agent_endpoint", None
        ):
            try:
                self.agent_endpoint = check_agent_endpoint(self.agent_endpoint)
            except ValidationError as exc:
                raise ValidationError({"agent_endpoint": exc.messages}) from None

    def gpus_allocated(self, *, exclude_instance_id: int | None = None) -> int:
        qs = self.instances.all()
        if exclude_instance_id is not None:
            qs = qs.exclude(pk=exclude_instance_id)
        return qs.aggregate(total=models.Sum("gpu_count"))["total"] or 0

    def gpus_free(self) -> int:
        return self.gpu_count - self.gpus_allocated()


class Instance(models.Model):
    role = models.CharField(
        max_length=16,
        choices=InstanceRole.choices,
        help_text="prefill (P), relay_decode (RLD) or main_decode (MD).",
    )
    node = models.ForeignKey(
        "fleet.Node",
        on_delete=models.PROTECT,
        related_name="instances",
        help_text="The node the engine runs on.",
    )
    served_model = models.ForeignKey(
        "fleet.ServedModel",
        on_delete=models.PROTECT,
        related_name="instances",
        help_text="The model the engine serves.",
    )
    gpu_count = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(1024)],
        help_text="GPUs of the node this instance uses.",
    )
    desired_state = models.CharField(
        max_length=16,
        choices=DesiredState.choices,
        default=DesiredState.RUNNING,
        help_text="What the operator wants: running, drained or stopped.",
    )
    actual_state = models.CharField(
        max_length=16,
        choices=ActualState.choices,
        default=ActualState.PENDING,
        help_text="What the agent last reported.",
    )
    state_changed_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When actual_state last changed.",
    )
    last_report = models.JSONField(
        default=dict,
        blank=True,
        help_text="The instance's part of the latest heartbeat: load, KV usage, cache stats.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node__datacenter__name", "role", "id"]

    def __str__(self) -> str:
        return f"{self.role}#{self.pk} {self.served_model.name} on {self.node.hostname}"

    @property
    def datacenter(self):
        return self.node.datacenter

    @staticmethod
    def check_placement(
        *,
        role: str,
        node: Node,
        served_model,
        gpu_count: int,
        instance_id: int | None = None,
    ) -> None:
        """Raise ValidationError naming the field if an instance cannot go where it asks to."""
        allocated = node.gpus_allocated(exclude_instance_id=instance_id)
        free = node.gpu_count - allocated
        if gpu_count > free:
            raise ValidationError(
                {
                    "gpu_count": (
                        f"Node {node.hostname} has {free} free GPU(s) of {node.gpu_count}; "
                        f"this instance asks for {gpu_count}."
                    )
                }
            )
        if role == InstanceRole.RELAY_DECODE:
            # The relay exists to take KV over the fast fabric from a prefill in the same site.
            prefill_here = Instance.objects.filter(
                role=InstanceRole.PREFILL,
                served_model=served_model,
                node__datacenter_id=node.datacenter_id,
            )
            if instance_id is not None:
                prefill_here = prefill_here.exclude(pk=instance_id)
            if not prefill_here.exists():
                raise ValidationError(
                    {
                        "role": (
                            f"A relay_decode instance needs a prefill instance of "
                            f"{served_model.name} in datacenter {node.datacenter.name}; "
                            "create the prefill instance first."
                        )
                    }
                )

    def clean(self) -> None:
        super().clean()
        if self.node_id and self.served_model_id and self.role and self.gpu_count:
            Instance.check_placement(
                role=self.role,
                node=self.node,
                served_model=self.served_model,
                gpu_count=self.gpu_count,
                instance_id=self.pk,
            )
        if self.pk is None and self.desired_state not in DesiredState.values:
            raise ValidationError({"desired_state": "Unknown desired state."})
