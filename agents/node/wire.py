"""Data-plane request bodies (parsed and checked, with the field named on error) and the NDJSON
events of a token stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents.engine import SamplingParams, TokenLogprob, TokenOutput
from agents.node.errors import AgentError
from pdd.events import ErrorEvent, TokenEvent
from pdd.hardware import GpuType, unit_from_json
from pdd.kv_formats import KV_FORMATS
from pdd.token_ids import from_wire
from pdd.vocab import AGENT_HANDOFF_MODES, AGENT_PIPELINES, ROLE_TOKENS, HandoffMode

# rld-only: singular traffic and the no-MD fallback; P ships KV to RLD only, RLD finishes.
PIPELINES = AGENT_PIPELINES
HANDOFF_MODES = AGENT_HANDOFF_MODES
DEFAULT_CATCH_UP_BATCH = 64
DEFAULT_MAX_CATCH_UP_BATCHES = 8
# Short role names in token events and per-request counts.
ROLE_SHORT = ROLE_TOKENS


def bad(field: str, reason: str) -> AgentError:
    return AgentError(400, f"{field}: {reason}", field)


def need_dict(body: Any, field: str = "body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(field, "must be a JSON object")
    return body


def get_int(body: dict, field: str, default: Any = ..., minimum: int | None = None) -> Any:
    value = body.get(field, default)
    if value is ...:
        raise bad(field, "required")
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(field, f"must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise bad(field, f"must be >= {minimum}, got {value}")
    return value


def get_bool(body: dict, field: str, default: bool = False) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise bad(field, f"must be true or false, got {type(value).__name__}")
    return value


def get_str(body: dict, field: str, default: Any = ..., choices: tuple[str, ...] = ()) -> Any:
    value = body.get(field, default)
    if value is ...:
        raise bad(field, "required")
    if value is None and default is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad(field, "must be a non-empty string")
    if choices and value not in choices:
        raise bad(field, f"must be one of {[str(c) for c in choices]}, got {value!r}")
    if "|" in value:
        raise bad(field, "must not contain '|'")
    return value


def get_ids(body: dict, field: str, vocab_size: int | None = None, allow_empty=False) -> list[int]:
    """Token ids as a JSON list of integers, or packed (a string, pdd.token_ids)."""
    value = body.get(field, ...)
    if value is ...:
        raise bad(field, "required")
    if isinstance(value, str):
        try:
            ids = from_wire(value)
        except ValueError as exc:
            raise bad(field, str(exc)) from None
        if not ids and not allow_empty:
            raise bad(field, "must be a non-empty list of token ids")
        if ids and vocab_size is not None and (top := max(ids)) >= vocab_size:
            raise bad(field, f"token id {top} outside the vocabulary [0, {vocab_size})")
        return ids
    if not isinstance(value, list) or (not value and not allow_empty):
        raise bad(field, "must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(field, "must hold integers only")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad(field, f"token id {t} outside the vocabulary [0, {vocab_size})")
    return value


def parse_sampling(raw: Any) -> SamplingParams:
    body = need_dict({} if raw is None else raw, "sampling")
    known = {
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
    }
    unknown = set(body) - known
    if unknown:
        raise bad("sampling", f"unknown keys {sorted(unknown)}")
    max_tokens = get_int(body, "max_tokens", 16, minimum=1)
    seed = get_int(body, "seed", None)
    logprobs = get_int(body, "logprobs", None, minimum=0)
    numbers = {}
    for name, default in (("temperature", 0.0), ("top_p", 1.0)):
        value = body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"sampling.{name}", "must be a number")
        numbers[name] = float(value)
    stop = body.get("stop_token_ids", [])
    if not isinstance(stop, list) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in stop
    ):
        raise bad("sampling.stop_token_ids", "must be a list of integers")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("sampling.ignore_eos", "must be a boolean")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=tuple(stop),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            **numbers,
        )
    except ValueError as exc:
        raise bad("sampling", str(exc)) from None


def sampling_json(s: SamplingParams) -> dict[str, Any]:
    body = {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    if s.logprobs is not None:  # only when asked: a peer of an older build refuses the key
        body["logprobs"] = s.logprobs
    return body


@dataclass(slots=True)
class Peer:
    """Where another instance is: its agent's HTTP base URL and KV fabric addresses."""

    http: str
    kv_host: str
    kv_port: int
    instance: str
    datacenter: str | None = None
    wan_port: int | None = None
    # The KV format to send this peer across the WAN (the link's kv_format): None for the
    # engine's own; a float dtype name or "int8" (agents/engine/kv_codec.py).
    kv_format: str | None = None

    @classmethod
    def parse(cls, raw: Any, field: str) -> Peer:
        body = need_dict(raw, field)
        http = body.get("http")
        if not isinstance(http, str) or not http.startswith(("http://", "https://")):
            raise bad(f"{field}.http", "must be an http(s) URL")
        kv_host = body.get("kv_host")
        if not isinstance(kv_host, str) or not kv_host:
            raise bad(f"{field}.kv_host", "required string")
        kv_port = get_int(body, "kv_port", minimum=1)
        wan_port = get_int(body, "wan_port", None, minimum=1)
        instance = body.get("instance")
        if isinstance(instance, int) and not isinstance(instance, bool):
            instance = str(instance)
        if not isinstance(instance, str) or not instance or "|" in instance:
            raise bad(f"{field}.instance", "required instance id (string)")
        datacenter = get_str(body, "datacenter", None)
        kv_format = get_str(body, "kv_format", None) or None
        if kv_format is not None and kv_format not in KV_FORMATS:
            raise bad(f"{field}.kv_format", f"must be one of {', '.join(KV_FORMATS)}")
        return cls(http.rstrip("/"), kv_host, kv_port, instance, datacenter, wan_port, kv_format)

    def to_json(self) -> dict[str, Any]:
        return {
            "http": self.http,
            "kv_host": self.kv_host,
            "kv_port": self.kv_port,
            "wan_port": self.wan_port,
            "instance": self.instance,
            "datacenter": self.datacenter,
            **({"kv_format": self.kv_format} if self.kv_format else {}),
        }

    def kv_address(self, cross_dc: bool) -> tuple[str, int]:
        return self.kv_host, (self.wan_port if cross_dc and self.wan_port else self.kv_port)


@dataclass(slots=True)
class HandoffPlan:
    mode: str = HandoffMode.ONE_SHOT
    catch_up_batch: int = DEFAULT_CATCH_UP_BATCH
    handoff_at: int = 0  # RLD generates at least this many tokens before handing off
    max_catch_up_batches: int = DEFAULT_MAX_CATCH_UP_BATCHES

    @classmethod
    def parse(cls, body: dict) -> HandoffPlan:
        return cls(
            get_str(body, "handoff_mode", HandoffMode.ONE_SHOT, HANDOFF_MODES),
            get_int(body, "catch_up_batch", DEFAULT_CATCH_UP_BATCH, minimum=1),
            get_int(body, "handoff_at", 0, minimum=0),
            get_int(body, "max_catch_up_batches", DEFAULT_MAX_CATCH_UP_BATCHES, minimum=0),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "handoff_mode": self.mode,
            "catch_up_batch": self.catch_up_batch,
            "handoff_at": self.handoff_at,
            "max_catch_up_batches": self.max_catch_up_batches,
        }


def token_event(
    index: int, token_id: int, role: str, logprob: TokenLogprob | None = None
) -> dict[str, Any]:
    """A token event; with `logprob` (the request asked for logprobs) it carries ``logprob``
    and ``top_logprobs`` as [[token id, logprob], ...], most likely first."""
    return TokenEvent(
        index,
        token_id,
        role,
        logprob.logprob if logprob is not None else None,
        tuple((t, v) for t, v in logprob.top) if logprob is not None else None,
    ).to_json()


def output_logprob(out: TokenOutput, j: int) -> TokenLogprob | None:
    """The logprob of the j-th token of an engine output, when the request asked for them."""
    return out.logprobs[j] if out.logprobs else None


def relayed_token(index: int, event: dict[str, Any], role: str) -> dict[str, Any]:
    """A peer's token event re-emitted at `index`, its logprobs (when any) kept."""
    relayed = token_event(index, event["token_id"], role)
    if "logprob" in event:
        relayed["logprob"] = event["logprob"]
        relayed["top_logprobs"] = event.get("top_logprobs") or []
    return relayed


def error_event(message: str, code: str = "", role: str = "") -> dict[str, Any]:
    """An error event; ``code`` ENGINE_FULL when an engine had no room (capacity, not a
    fault: the gateway queues the request and retries it); ``role`` the role that failed
    (``md``, ``rld``) when it is not the reporting agent's own: the gateway blames it."""
    return ErrorEvent(message, code, role).to_json()


def refused(exc: ValueError) -> AgentError:
    """A 400 for a checker's ``"<field>: <reason>"`` ValueError, naming the field."""
    message = str(exc)
    return AgentError(400, message, message.split(":")[0] if ":" in message else None)


def parse_gpu(raw: Any) -> GpuType:
    """The GPU unit of a start command's ``gpu`` object (the fleet's per-chip numbers and the
    instance's chip count: pdd.hardware.unit_from_json); 400 naming the field."""
    try:
        return unit_from_json(raw)
    except ValueError as exc:
        raise refused(exc) from None
