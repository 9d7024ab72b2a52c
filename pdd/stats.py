"""The statistics P's ``done`` event carries (agents/PROTOCOL.md, "done"), as typed records.

The agents write them as JSON; readers parse them once with ``DoneStats.from_json``, which
keeps only well-formed values (a finite number where a duration is expected, a count >= 0)
and leaves the rest at their defaults, so a reader never digs into raw dicts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value if value >= 0 else default
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return int(value)
    return default


def _counts(raw: Any, keys: tuple[str, ...]) -> dict[str, int]:
    raw = raw if isinstance(raw, dict) else {}
    return {k: _count(raw.get(k)) for k in keys}


@dataclass(slots=True)
class HandoffStats:
    """RLD -> MD: the mode, the index of MD's first token (None: no handoff), batches sent,
    whether MD took over, why not."""

    mode: str = "none"
    at_token: int | None = None
    batches: int = 0
    completed: bool = False
    failed: str | None = None
    tokens_handed: int = 0
    slot_wait_s: float = 0.0

    @classmethod
    def from_json(cls, raw: Any) -> HandoffStats:
        if not isinstance(raw, dict):
            return cls()
        at = raw.get("at_token")
        return cls(
            mode=str(raw.get("mode") or "none"),
            at_token=_count(at) if isinstance(at, int) and not isinstance(at, bool) else None,
            batches=_count(raw.get("batches")),
            completed=raw.get("completed") is True,
            failed=str(raw["failed"]) if raw.get("failed") else None,
            tokens_handed=_count(raw.get("tokens_handed")),
            slot_wait_s=_seconds(raw.get("slot_wait_s")) or 0.0,
        )


FABRICS = ("intra_dc", "wan")
ROLES = ("prefill", "rld", "md")


@dataclass(slots=True)
class DoneStats:
    """One attempt's figures as P reports them when its stream ends."""

    pipeline: str = ""
    ttft_s: float | None = None
    prefill_s: float | None = None
    kv_wait_s: float | None = None
    max_gap_s: float | None = None
    e2e_s: float | None = None
    first_token_early: bool | None = None  # None: not reported
    prefill_cached_tokens: int = 0
    cached_tokens: int | None = None  # MD's DRC hit; None: not reported
    tokens_by_role: dict[str, int] | None = None  # None: not reported
    kv_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FABRICS, 0))
    kv_wire_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FABRICS, 0))
    handoff_bytes: int = 0
    handoff: HandoffStats = field(default_factory=HandoffStats)
    main_error: str | None = None
    kv_format_wan: str = ""  # the format P sent MD's KV in across the WAN ("": its own)
    kv_stream_pieces: int = 0  # pieces of a streamed export (0: sent whole after prefill)

    @classmethod
    def from_json(cls, raw: Any) -> DoneStats:
        if not isinstance(raw, dict):
            return cls()
        early = raw.get("first_token_early")
        cached = raw.get("cached_tokens")
        return cls(
            pipeline=str(raw.get("pipeline") or ""),
            ttft_s=_seconds(raw.get("ttft_s")),
            prefill_s=_seconds(raw.get("prefill_s")),
            kv_wait_s=_seconds(raw.get("kv_wait_s")),
            max_gap_s=_seconds(raw.get("max_gap_s")),
            e2e_s=_seconds(raw.get("e2e_s")),
            first_token_early=early if isinstance(early, bool) else None,
            prefill_cached_tokens=_count(raw.get("prefill_cached_tokens")),
            cached_tokens=None if cached is None else _count(cached),
            tokens_by_role=(
                _counts(raw["tokens_by_role"], ROLES)
                if isinstance(raw.get("tokens_by_role"), dict)
                else None
            ),
            kv_bytes=_counts(raw.get("kv_bytes"), FABRICS),
            kv_wire_bytes=_counts(raw.get("kv_wire_bytes"), FABRICS),
            handoff_bytes=_count(raw.get("handoff_bytes")),
            handoff=HandoffStats.from_json(raw.get("handoff")),
            main_error=str(raw["main_error"]) if raw.get("main_error") else None,
            kv_format_wan=str(raw.get("kv_format_wan") or "")[:16],
            kv_stream_pieces=_count(raw.get("kv_stream_pieces")),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
