"""Model profiles: a served model described by numbers instead of weights, for the emulated
engine. A profile is the planner's ModelSpec and EngineSpec plus what a running engine needs
(vocabulary, context window, weights resident per unit), so the planner and the live emulated
fleet take their step times from the same numbers (pdd/hardware.py).

A served model whose ``source`` is ``profile:<name>`` (a built-in profile below) or
``profile:<path to a JSON file>`` runs on the emulated engine; anything else loads weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdd.hardware import EngineSpec, GpuType, ModelSpec, kv_capacity_tokens
from pdd.spec import build, check_int, check_positive, strip_comments

PROFILE_PREFIX = "profile:"
# The emulated engine speaks the byte tokenizer's ids (0..255 and three specials), so a gateway
# tokenizes an emulated model's prompts with no tokenizer file.
BYTE_VOCAB = 259


@dataclass(slots=True)
class ModelProfile:
    """What the emulated engine needs to behave, and take the time, of a served model."""

    name: str
    model: ModelSpec
    engine: EngineSpec
    # Weights resident on every unit that serves the model; the KV pool gets the rest of the
    # unit's memory (kv_capacity_tokens).
    resident_weight_gb: float
    max_position: int = 262_144  # context window (prompt + output), tokens

    def __post_init__(self) -> None:
        check_positive(self, "resident_weight_gb")
        check_int(self, "max_position", 2)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def kv_capacity_tokens(self, gpu: GpuType) -> int:
        """Tokens of KV one unit of ``gpu`` holds beside the resident weights."""
        return kv_capacity_tokens(self.model, gpu, self.resident_weight_gb)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": asdict(self.model),
            "engine": asdict(self.engine),
            "resident_weight_gb": self.resident_weight_gb,
            "max_position": self.max_position,
        }


# DeepSeek-V4-pro-like, the model of the published PDD experiment: the same numbers as the
# planner's shared scenario defaults (planner/scenarios/_common.json: fleet.model,
# fleet.engine, fleet.resident_weight_gb); a test keeps the two equal. Where each number comes
# from (published figure, derivation or calibration) is written beside it there and in
# docs/emulation.md.
PAPER = {
    "name": "paper-dsv4",
    "model": {
        "name": "DeepSeek-V4-pro-like",
        "active_params_b": 37,
        "attn_flops_per_token_ctx": 2_500_000,
        "kv_bytes_per_token": 4400,
        "decode_weight_gb": 20,
        "decode_expert_gb": 380,
        "routed_experts": 256,
        "experts_per_token": 8,
    },
    "engine": {
        "prefill_efficiency": 0.22,
        "prefill_overhead_s": 0.03,
        "prefill_batch_tokens": 16384,
        "decode_mem_efficiency": 0.143,
        "decode_overhead_s": 0.0,
        "max_decode_batch": 128,
        "prefill_half_tokens": 4096,
        "prefill_order": "fifo",
    },
    "resident_weight_gb": 400,
}

BUILT_IN: dict[str, Mapping[str, Any]] = {"paper-dsv4": PAPER}

# The published experiment's two GPU types as a start command's "gpu" objects (per chip, units of
# 8): GPU-A a flagship (8 x 989 TFLOPS, 80 GB, 3.35 TB/s), GPU-B at 81% of its compute and 2.1x
# its bandwidth with 141 GB (docs/pdd.md's lopsidedness): the planner's GPU-A / GPU-B units.
PAPER_GPUS: dict[str, dict[str, Any]] = {
    "GPU-A": {
        "name": "GPU-A",
        "count": 8,
        "peak_bf16_tflops": 989.0,
        "memory_gib": 80 / 1.073741824,
        "memory_bandwidth_gbps": 3350.0,
        "interconnect_gbps": 50.0,
    },
    "GPU-B": {
        "name": "GPU-B",
        "count": 8,
        "peak_bf16_tflops": 989.0 * 0.81,
        "memory_gib": 141 / 1.073741824,
        "memory_bandwidth_gbps": 3350.0 * 2.1,
        "interconnect_gbps": 50.0,
    },
}


def is_profile_source(source: str) -> bool:
    """Whether a served model's source names a profile (emulated) rather than weights."""
    return source.startswith(PROFILE_PREFIX)


def profile_from_dict(data: Any, where: str = "profile") -> ModelProfile:
    """A ModelProfile from its JSON form; ValueError naming the bad field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: must be an object")
    data = strip_comments(data)
    for key in ("name", "model", "engine", "resident_weight_gb"):
        if key not in data:
            raise ValueError(f"{where}.{key}: required")
    unknown = set(data) - {"name", "model", "engine", "resident_weight_gb", "max_position"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    if not isinstance(data["name"], str) or not data["name"]:
        raise ValueError(f"{where}.name: must be a non-empty string")
    try:
        return ModelProfile(
            name=data["name"],
            model=build(ModelSpec, data["model"], f"{where}.model"),
            engine=build(EngineSpec, data["engine"], f"{where}.engine"),
            resident_weight_gb=data["resident_weight_gb"],
            max_position=data.get("max_position", 262_144),
        )
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def load_profile(source: str) -> ModelProfile:
    """The profile a ``profile:<name or JSON path>`` source names; ValueError if none."""
    if not is_profile_source(source):
        raise ValueError(f"source: {source!r} does not start with {PROFILE_PREFIX!r}")
    ref = source[len(PROFILE_PREFIX) :]
    if ref in BUILT_IN:
        return profile_from_dict(BUILT_IN[ref], f"profile {ref}")
    path = Path(ref)
    if not ref.endswith(".json") or not path.is_file():
        raise ValueError(
            f"source: {source!r} names no profile: use one of "
            f"{', '.join(PROFILE_PREFIX + n for n in sorted(BUILT_IN))} or "
            f"{PROFILE_PREFIX}<path to a .json file>"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"source: {path} is not readable JSON ({exc})") from None
    return profile_from_dict(data, f"profile {path}")
