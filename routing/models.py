"""Routing records: the live policy settings, every request, and the decision taken for it."""

from __future__ import annotations

from django.db import models

from routing.choices import HandoffChoice, PipelineChoice, RequestStatus


class RoutingPolicyConfig(models.Model):
    """The one row of policy settings every gateway follows; `version` bumps on each change."""

    settings = models.JSONField(
        default=dict,
        help_text="pdd.policy.PolicySettings as a dict; missing keys take the defaults.",
    )
    version = models.PositiveIntegerField(
        default=1,
        help_text="Increases on every change; gateways reload when it moves.",
    )
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True)

    class Meta:
        verbose_name = "routing policy"

    def __str__(self) -> str:
        return f"routing policy v{self.version}"


class RequestRecord(models.Model):
    request_id = models.CharField(
        max_length=64,
        unique=True,
        help_text="Gateway request id (also the OpenAI response id).",
    )
    client_request_id = models.CharField(
        max_length=128,
        blank=True,
        db_index=True,
        help_text="The X-Request-Id the client sent (echoed on the answer), if valid.",
    )
    tenant = models.ForeignKey(
        "billing.Tenant",
        on_delete=models.PROTECT,
        related_name="requests",
        help_text="Who sent it.",
    )
    model = models.CharField(max_length=128, help_text="Served model name.")
    emulated = models.BooleanField(
        default=False,
        help_text=(
            "Served by the emulated engine (a model profile on modelled GPUs, not a real model), "
            "as the served model's source said when the request was recorded."
        ),
    )
    endpoint = models.CharField(max_length=32, help_text="chat.completions or completions.")
    stream = models.BooleanField(default=False)
    status = models.CharField(max_length=16, choices=RequestStatus.choices)
    error = models.TextField(blank=True, help_text="What went wrong, if it did.")
    pipeline = models.CharField(max_length=16, choices=PipelineChoice.choices, blank=True)
    handoff_mode = models.CharField(max_length=16, choices=HandoffChoice.choices, blank=True)
    handoff_at_token = models.IntegerField(
        null=True, blank=True, help_text="Output index MD took over at."
    )
    handoff_batches = models.PositiveIntegerField(default=0)
    migrations = models.PositiveIntegerField(
        default=0,
        help_text="Times the request moved to another decoder after its decoder failed "
        "mid-stream (prompt plus the tokens already delivered re-sent).",
    )
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(
        default=0, help_text="Prompt tokens served from cache."
    )
    completion_tokens = models.PositiveIntegerField(default=0)
    tokens_by_rld = models.PositiveIntegerField(
        default=0, help_text="Output tokens decoded by RLD."
    )
    tokens_by_md = models.PositiveIntegerField(default=0, help_text="Output tokens decoded by MD.")
    ttft_s = models.FloatField(
        null=True,
        blank=True,
        help_text="Time to first token, seconds: from the gateway receiving the request to the "
        "user's first token, which leaves with the decoding role's stream (MD in p-md, RLD in "
        "p-rld-md), so it counts the KV transfer that role waited for.",
    )
    prefill_s = models.FloatField(
        null=True, blank=True, help_text="Prefill time on P, seconds (P's first token ready)."
    )
    kv_wait_s = models.FloatField(
        null=True,
        blank=True,
        help_text="From P's token ready to the decoding role's first token: KV export, "
        "transfer and the decoding role's admission, seconds.",
    )
    max_gap_s = models.FloatField(
        null=True,
        blank=True,
        help_text="Largest gap between consecutive tokens at the gateway (the handoff's stall), "
        "seconds.",
    )
    first_token_early = models.BooleanField(
        default=False,
        help_text="P's token was streamed when prefill ended (policy stream_first_token_early), "
        "so ttft_s is prefill time only.",
    )
    tpot_s = models.FloatField(
        null=True, blank=True, help_text="Mean time per output token after the first, s."
    )
    e2e_s = models.FloatField(null=True, blank=True, help_text="End-to-end latency, seconds.")
    finish_reason = models.CharField(
        max_length=16,
        blank=True,
        help_text="Why generation ended, as OpenAI says it (stop, length); blank when the "
        "request did not finish (error, cancelled, rejected, interrupted).",
    )
    kv_bytes_intra_dc = models.BigIntegerField(
        default=0, help_text="KV bytes over the intra-DC fabric."
    )
    kv_bytes_wan = models.BigIntegerField(default=0, help_text="KV bytes over the WAN.")
    kv_format_wan = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="Format of the KV sent across the WAN (the link's kv_format; empty: the "
        "engine's own).",
    )
    handoff_bytes = models.BigIntegerField(
        default=0, help_text="Bytes of token ids handed RLD -> MD."
    )
    prefill_instance = models.CharField(max_length=32, blank=True)
    relay_instance = models.CharField(max_length=32, blank=True)
    main_instance = models.CharField(max_length=32, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "created_at"]),
            models.Index(fields=["pipeline", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.pipeline or '-'} {self.status}"


class RoutingDecision(models.Model):
    request = models.OneToOneField(
        "routing.RequestRecord",
        on_delete=models.CASCADE,
        related_name="decision",
        help_text="The request this decision routed.",
    )
    policy_version = models.PositiveIntegerField(help_text="RoutingPolicyConfig.version used.")
    pipeline = models.CharField(max_length=16, choices=PipelineChoice.choices)
    handoff_mode = models.CharField(max_length=16, choices=HandoffChoice.choices)
    cached_tokens = models.PositiveIntegerField()
    delta_tokens = models.PositiveIntegerField()
    est_wan_s = models.FloatField(
        null=True, blank=True, help_text="Estimated WAN time of the KV delta, s."
    )
    fallback = models.BooleanField(default=False)
    reason = models.TextField(help_text="Why, in words.")
    inputs = models.JSONField(
        default=dict, help_text="The snapshot and request facts the policy saw."
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.pipeline}/{self.handoff_mode}: {self.reason[:60]}"


class Admission(models.Model):
    """A request the gateway accepted and has not recorded yet: written at admission, removed
    in the transaction that writes its RequestRecord. One left behind by a gateway process that
    died (SIGKILL, a crash) is finished by a later process as an ``interrupted`` record with the
    tokens the prefill agent reports it streamed (``finish_interrupted`` in
    routing/gateway/records.py)."""

    request_id = models.CharField(max_length=64, unique=True)
    client_request_id = models.CharField(
        max_length=128, blank=True, help_text="The client's X-Request-Id, for its record."
    )
    tenant = models.ForeignKey("billing.Tenant", on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey(
        "billing.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    model = models.CharField(max_length=128)
    endpoint = models.CharField(max_length=32)
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    decision = models.JSONField(default=dict, help_text="The routing decision, as a dict.")
    decision_inputs = models.JSONField(default=dict)
    policy_version = models.PositiveIntegerField(default=0)
    owner = models.CharField(
        max_length=128, help_text="host:pid of the gateway process serving the request."
    )
    delivered_tokens = models.PositiveIntegerField(
        default=0, help_text="Tokens sent to the client so far (updated every few seconds)."
    )
    # The attempt now running (a retry or a migration starts a new one on the agents).
    attempt_request_id = models.CharField(
        max_length=80, blank=True, help_text="The request id the agents know the attempt by."
    )
    prefill_url = models.CharField(
        max_length=300, blank=True, help_text="The prefill agent the attempt streams from."
    )
    token_offset = models.PositiveIntegerField(
        default=0, help_text="Tokens delivered before the attempt began (a migration's start)."
    )
    admitted_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["admitted_at"]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.owner})"


class CacheVersion(models.Model):
    """A counter per kind of cached data (``auth``: API keys and tenants, ``models``: served
    models, ``topology``: the fleet's instances, nodes and links). A save that changes such
    data bumps it; every gateway process reads the counters at most every half second and
    empties a cache whose counter moved (routing/caching.py)."""

    name = models.CharField(max_length=32, primary_key=True)
    version = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"
