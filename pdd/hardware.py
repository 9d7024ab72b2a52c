"""Modelled chips, model and engine: the formulas that turn tokens into seconds, shared by
the planner's simulator and the agents' emulated engine (one hardware model, one copy).

Prefill is compute-bound (FLOPs over peak compute times an efficiency); a decode step is
memory-bound (the weights its batch touches plus the batch's KV, read once over memory
bandwidth). In an MoE model a decode step reads the dense weights and only the routed experts
its batch's tokens pick, so a small batch (a lightly loaded relay) steps faster than a full one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.checks import check_number
from pdd.spec import check_int, check_non_negative, check_positive, check_range


@dataclass(slots=True)
class GpuType:
    """One priced unit of a chip type (a node in the published fleet counts), in four numbers."""

    name: str
    peak_tflops: float  # dense compute of the unit
    mem_gb: float  # memory capacity of the unit
    mem_bw_tbps: float  # memory bandwidth of the unit, TB/s
    interconnect_gbps: float  # intra-datacenter (RDMA) NIC bandwidth of the unit
    unit_price: float  # price per unit-hour, any currency, only ratios matter for BCR

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "mem_gb", "mem_bw_tbps", "interconnect_gbps", "unit_price"):
            check_positive(self, name)


@dataclass(slots=True)
class ModelSpec:
    """The served model, reduced to what the cost formulas need."""

    name: str
    active_params_b: float  # parameters touched per token (MoE active), billions
    attn_flops_per_token_ctx: float  # attention FLOPs per new token per context token
    kv_bytes_per_token: int
    # Weight bytes every decode step reads on one unit: all of them for a dense model; for an
    # MoE model (``routed_experts`` > 0) the dense part (attention, shared experts, embeddings).
    decode_weight_gb: float
    # MoE routed experts: bytes of them resident on one decode unit, how many experts each
    # layer has and how many each token picks. A step reads the experts its batch picks; with
    # uniform routing a batch of b tokens touches 1 - (1 - k/E)^b of them. 0 = dense model.
    decode_expert_gb: float = 0.0
    routed_experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        for name in ("active_params_b", "attn_flops_per_token_ctx", "decode_weight_gb"):
            check_positive(self, name)
        check_int(self, "kv_bytes_per_token", 1)
        check_non_negative(self, "decode_expert_gb")
        check_int(self, "routed_experts", 0)
        check_int(self, "experts_per_token", 0)
        moe = (self.decode_expert_gb > 0, self.routed_experts > 0, self.experts_per_token > 0)
        if any(moe) and not all(moe):
            raise ValueError(
                "decode_expert_gb, routed_experts, experts_per_token: set all three (MoE) or none"
            )
        if self.experts_per_token > self.routed_experts:
            raise ValueError("experts_per_token: must be <= routed_experts")

    def expert_fraction_touched(self, batch: int) -> float:
        """Share of the unit's routed experts a decode step of ``batch`` tokens reads."""
        if not self.routed_experts or batch <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.routed_experts) ** batch

    def decode_weight_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of ``batch`` running requests reads on one unit."""
        touched = self.decode_expert_gb * self.expert_fraction_touched(batch)
        return (self.decode_weight_gb + touched) * 1e9

    def prefill_flops(self, new_tokens: int, cached_tokens: int) -> float:
        # Linear layers cost 2 FLOPs per active parameter per token; causal attention over the
        # cached prefix plus, on average, half of the new tokens.
        linear = 2e9 * self.active_params_b * new_tokens
        attn = self.attn_flops_per_token_ctx * new_tokens * (cached_tokens + new_tokens / 2)
        return linear + attn


PREFILL_ORDERS = ("fifo", "srpt")


@dataclass(slots=True)
class EngineSpec:
    """Scheduler and efficiency settings of the engines (assumptions, not chip facts)."""

    prefill_efficiency: float = 0.45  # achieved / peak FLOPs on a large batch
    prefill_overhead_s: float = 0.03  # fixed per forward pass: launch, all-to-all, sampling
    prefill_batch_tokens: int = 16_384  # token budget of one prefill batch (chunk)
    decode_mem_efficiency: float = 0.7  # achieved / peak memory bandwidth
    # Fixed per decode step (communication, sampling), independent of the chip. The measured
    # 2.1x decode of GPU-B over GPU-A (docs/pdd.md; it has 2.1x the bandwidth) leaves no room:
    # the scenarios set 0 (see _common.json); >= 0.
    decode_overhead_s: float = 0.008
    max_decode_batch: int = 128  # running requests per decode unit
    # Tokens in one prefill pass at which the pass runs at half its full-batch efficiency:
    # an MoE layer splits a pass's tokens over its experts, so a small pass gives each expert
    # GEMM few rows and runs far below peak. 0 = efficiency independent of the pass size.
    prefill_half_tokens: int = 0
    # Which queued request a prefill pass serves first: "fifo" (arrival order; what Baton's
    # agents do) or "srpt" (fewest new tokens left first, re-chosen at every chunk boundary:
    # short requests overtake a long one between its chunks; long ones can wait without bound).
    prefill_order: str = "fifo"

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill_order: must be one of {', '.join(PREFILL_ORDERS)}, "
                f"got {self.prefill_order!r}"
            )
        check_int(self, "prefill_half_tokens", 0)
        check_int(self, "prefill_batch_tokens", 1)
        check_int(self, "max_decode_batch", 1)
        # Achieved over peak: above 1 is no chip.
        check_range(self, "prefill_efficiency", 0.0, 1.0, open_lo=True)
        check_range(self, "decode_mem_efficiency", 0.0, 1.0, open_lo=True)
        check_range(self, "prefill_overhead_s", 0.0, 10.0)
        check_range(self, "decode_overhead_s", 0.0, 10.0)


def prefill_efficiency(tokens: int, engine: EngineSpec) -> float:
    """Achieved / peak FLOPs of a pass of ``tokens``: ``prefill_efficiency`` at a full batch.

    With ``prefill_half_tokens`` = h, efficiency scales as t / (t + h), normalised so that a
    full ``prefill_batch_tokens`` pass runs at ``prefill_efficiency``.
    """
    h = engine.prefill_half_tokens
    if not h:
        return engine.prefill_efficiency
    full = engine.prefill_batch_tokens
    t = max(tokens, 1)
    return engine.prefill_efficiency * (full + h) / full * t / (t + h)


def prefill_batch_time(
    flops: float, gpu: GpuType, engine: EngineSpec, tokens: int | None = None
) -> float:
    """Seconds for one prefill forward pass doing ``flops`` over ``tokens`` on one unit."""
    eff = engine.prefill_efficiency if tokens is None else prefill_efficiency(tokens, engine)
    return engine.prefill_overhead_s + flops / (gpu.peak_tflops * 1e12 * eff)


def decode_step_time(
    batch_ctx_tokens: float,
    model: ModelSpec,
    gpu: GpuType,
    engine: EngineSpec,
    batch: int = 1,
) -> float:
    """Seconds for one decode step of ``batch`` running requests holding ``batch_ctx_tokens``.

    The step reads the weights the batch touches (all of a dense model; the dense part plus the
    picked routed experts of an MoE model) and every running request's KV, once.
    """
    bytes_read = model.decode_weight_bytes(batch) + batch_ctx_tokens * model.kv_bytes_per_token
    return engine.decode_overhead_s + bytes_read / (
        gpu.mem_bw_tbps * 1e12 * engine.decode_mem_efficiency
    )


def kv_capacity_tokens(model: ModelSpec, gpu: GpuType, resident_weight_gb: float) -> int:
    """Tokens of KV one unit can hold next to its resident weights."""
    free = max(gpu.mem_gb - resident_weight_gb, 0.0) * 1e9
    return int(free / model.kv_bytes_per_token)


# Units of the fleet database's GPU type rows (one chip): TFLOPS, GiB, GB/s, GB/s.
GIB_IN_GB = 1024**3 / 1e9


def unit_from_chips(
    *,
    name: str,
    count: int,
    peak_bf16_tflops: float,
    memory_gib: float,
    memory_bandwidth_gbps: float,
    interconnect_gbps: float,
    unit_price: float = 1.0,
) -> GpuType:
    """The modelled unit of ``count`` chips of one GPU type, from the fleet's per-chip numbers
    (memory in GiB, bandwidths in GB/s), as the planner and the emulated engine both use it."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: must be an integer >= 1, got {count!r}")
    return GpuType(
        name=name,
        peak_tflops=peak_bf16_tflops * count,
        mem_gb=memory_gib * GIB_IN_GB * count,
        mem_bw_tbps=memory_bandwidth_gbps * count / 1000.0,  # GB/s -> TB/s
        interconnect_gbps=interconnect_gbps * 8 * count,  # GB/s -> Gbit/s
        unit_price=unit_price,
    )


def forward_time(
    new_tokens: list[int],
    context_tokens: list[int],
    model: ModelSpec,
    gpu: GpuType,
    engine: EngineSpec,
) -> float:
    """Seconds for one engine forward in which request i runs ``new_tokens[i]`` positions on
    top of ``context_tokens[i]`` positions whose KV it already holds.

    A pure decode step (one position each) is memory-bound: `decode_step_time`. Any forward
    with more positions (a prefill chunk, the handoff's extend of k tokens) is the slower of
    its compute (`prefill_batch_time` over its FLOPs) and its memory read (weights its tokens
    touch plus the batch's KV): a roofline, so a short extend costs about one decode step and a
    long prefill chunk is compute-bound.
    """
    if len(new_tokens) != len(context_tokens) or not new_tokens:
        raise ValueError("new_tokens and context_tokens: one entry per request, at least one")
    held = sum(context_tokens) + sum(new_tokens)
    if all(n == 1 for n in new_tokens):
        return decode_step_time(held, model, gpu, engine, batch=len(new_tokens))
    tokens = sum(new_tokens)
    flops = sum(model.prefill_flops(n, c) for n, c in zip(new_tokens, context_tokens, strict=True))
    compute = prefill_batch_time(flops, gpu, engine, tokens)
    memory = decode_step_time(held, model, gpu, engine, batch=tokens)
    return max(compute, memory)


def transfer_time(num_bytes: float, gpu: GpuType) -> float:
    """Seconds to move ``num_bytes`` over the unit's interconnect (RDMA NICs)."""
    return num_bytes * 8 / (gpu.interconnect_gbps * 1e9)


# The per-chip numbers a start command's "gpu" object carries (the fleet's GPU type fields).
CHIP_FIELDS = ("peak_bf16_tflops", "memory_gib", "memory_bandwidth_gbps", "interconnect_gbps")


def unit_from_json(raw: object, where: str = "gpu") -> GpuType:
    """The unit a ``{"name", "count", <CHIP_FIELDS>}`` object describes; ValueError naming the
    field (``gpu.memory_gib: ...``)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: required: a non-empty string")
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 4096:
        raise ValueError(f"{where}.count: must be an integer in [1, 4096], got {count!r}")
    unknown = set(raw) - {"name", "count", *CHIP_FIELDS}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    numbers = {}
    for key in CHIP_FIELDS:
        if key not in raw:
            raise ValueError(f"{where}.{key}: required")
        numbers[key] = check_number(raw[key], f"{where}.{key}", gt=0)
    return unit_from_chips(name=name, count=count, **numbers)
