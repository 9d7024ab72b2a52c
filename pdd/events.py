"""The events of an agent's generate stream (agents/PROTOCOL.md, ``POST /v1/pdd/generate``) as
typed records: the agents build them (agents/node/wire.py) and the gateway parses each line
once (routing/gateway/runner.py), so neither side reads raw dicts.

- ``token``: ``{"type": "token", "index", "token_id", "role", "logprob"?, "top_logprobs"?}``
- ``done``: ``{"type": "done", "finish_reason", "stats"}`` (``stats``: ``pdd.stats.DoneStats``)
- ``error``: ``{"type": "error", "message"}``
- ``continue``: ``{"type": "continue", "url", "body", "instance", "role", "stats"}``: P's
  stream ends here (a ``direct`` call); the caller reads the rest from the decoding role
  (``ContinueEvent``)
- ``queued``: ``{"type": "queued", "waited_s", "waiting_for"}``: the agent holds the request
  and has no token for it yet (a keep-alive: busy, not frozen): P's engine queue
  (``waiting_for`` ``prefill``), or a decoder waiting for the request's KV (``kv``)

Any other type (an agent newer than this gateway) parses as ``OtherEvent`` and is ignored by
readers that do not know it; a known type with a malformed field is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdd.stats import DoneStats


def _int(raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"event field '{name}' must be an integer, got {value!r}")
    return value


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token of the answer at ``index`` (from 0 within the attempt), from ``role``
    (``prefill``, ``rld`` or ``md``); with logprobs when the request asked for them:
    ``top_logprobs`` as (token id, logprob) pairs, most likely first."""

    index: int
    token_id: int
    role: str = ""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "token",
            "index": self.index,
            "token_id": self.token_id,
            "role": self.role,
        }
        if self.logprob is not None:
            out["logprob"] = self.logprob
            out["top_logprobs"] = [[t, v] for t, v in self.top_logprobs or ()]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TokenEvent:
        top = None
        if isinstance(raw.get("top_logprobs"), list):
            pairs = []
            for pair in raw["top_logprobs"]:
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    token, value = pair
                    if isinstance(token, int) and not isinstance(token, bool):
                        number = _float_or_none(value)
                        if number is not None:
                            pairs.append((token, number))
            top = tuple(pairs)
        return cls(
            index=_int(raw, "index"),
            token_id=_int(raw, "token_id"),
            role=str(raw.get("role") or ""),
            logprob=_float_or_none(raw.get("logprob")),
            top_logprobs=top,
        )


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The attempt ended: why (``length``/``max_tokens`` or a stop) and P's figures."""

    finish_reason: str | None = None
    stats: DoneStats = field(default_factory=DoneStats)

    def to_json(self) -> dict[str, Any]:
        return {"type": "done", "finish_reason": self.finish_reason, "stats": self.stats.to_json()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DoneEvent:
        reason = raw.get("finish_reason")
        return cls(
            finish_reason=str(reason) if reason is not None else None,
            stats=DoneStats.from_json(raw.get("stats")),
        )

    @property
    def hit_length(self) -> bool:
        return self.finish_reason in ("length", "max_tokens")


ENGINE_FULL = "engine_full"  # ErrorEvent.code and the agents' 503 body's "code"
# The decoding roles an error event may name as the one that failed (ErrorEvent.role).
FAILING_ROLES = ("md", "rld")
# ErrorEvent.role of P's own failure after its stream started (a prefill that failed once its
# engine had queued it): the gateway blames P, as for a P that refused the call.
PREFILL_FAILED = "prefill"


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The attempt failed further down the path (MD, RLD or the WAN). ``code``
    ``"engine_full"``: an engine had no room for the request now (capacity, not a fault: the
    gateway queues and retries it, and blames no instance). ``role`` (``md``, ``rld``), when
    the agent that reports it knows: the role that failed (RLD reporting its MD's failure says
    ``md``); the gateway blames that role's instance, else the stream's own (routes.py).
    ``prefill`` (PREFILL_FAILED, from P only): P's own prefill failed after it was queued."""

    message: str = "agent error"
    code: str = ""
    role: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"type": "error", "message": self.message}
        if self.code:
            out["code"] = self.code
        if self.role:
            out["role"] = self.role
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ErrorEvent:
        role = raw.get("role")
        return cls(
            message=str(raw.get("message") or "agent error"),
            code=str(raw.get("code") or ""),
            role=role if role in FAILING_ROLES or role == PREFILL_FAILED else "",
        )


@dataclass(frozen=True, slots=True)
class ContinueEvent:
    """P prefilled and shipped the KV; the decoding role streams the rest of the answer (one hop
    per token): the caller POSTs ``body`` to ``url`` and reads that NDJSON stream as this one's
    continuation, from the same token indices. ``instance`` and ``role`` (``md`` or ``rld``)
    name the decoder; ``stats`` are P's figures (prefill time, cache hits, KV bytes), which
    the decoder's ``done`` completes."""

    url: str
    body: Mapping[str, Any]
    instance: str
    role: str
    stats: DoneStats = field(default_factory=DoneStats)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "continue",
            "url": self.url,
            "body": dict(self.body),
            "instance": self.instance,
            "role": self.role,
            "stats": self.stats.to_json(),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ContinueEvent:
        url, body = raw.get("url"), raw.get("body")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"event field 'url' must be an http(s) URL, got {url!r:.100}")
        if not isinstance(body, Mapping):
            raise ValueError("event field 'body' must be an object")
        role = raw.get("role")
        if role not in ("md", "rld"):
            raise ValueError(f"event field 'role' must be 'md' or 'rld', got {role!r:.40}")
        return cls(
            url=url,
            body=body,
            instance=str(raw.get("instance") or ""),
            role=role,
            stats=DoneStats.from_json(raw.get("stats")),
        )


@dataclass(frozen=True, slots=True)
class ReadyEvent:
    """MD, held for a handoff, has imported P's KV and holds a decode slot: RLD may hand the
    request over (MD's stream to RLD only). ``cached_tokens``: MD's own prefix it reused;
    ``received_tokens``: what came from P; ``slot_wait_s``: how long it waited for the slot."""

    cached_tokens: int = 0
    received_tokens: int = 0
    slot_wait_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "ready",
            "cached_tokens": self.cached_tokens,
            "received_tokens": self.received_tokens,
            "slot_wait_s": round(self.slot_wait_s, 4),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReadyEvent:
        def count(key: str) -> int:
            value = raw.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        wait = raw.get("slot_wait_s")
        return cls(
            cached_tokens=count("cached_tokens"),
            received_tokens=count("received_tokens"),
            slot_wait_s=float(wait) if isinstance(wait, int | float) and wait >= 0 else 0.0,
        )


@dataclass(frozen=True, slots=True)
class ExtendedEvent:
    """MD took a catch-up handoff batch into its context: it holds the tokens up to index
    ``upto`` (RLD sends the next batch, or the final one)."""

    upto: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "extended", "upto": self.upto}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ExtendedEvent:
        upto = raw.get("upto")
        if not isinstance(upto, int) or isinstance(upto, bool) or upto < 0:
            raise ValueError(f"extended event without a valid upto: {upto!r}")
        return cls(upto)


@dataclass(frozen=True, slots=True)
class QueuedEvent:
    """An agent's keep-alive while it holds the request with no token for it yet: P while its
    engine queues or prefills it (``waiting_for`` ``prefill``), a decoder while the request's
    KV is on its way (``kv``) and while its engine imports it and makes the first token
    (``engine``); ``waited_s`` since the wait began. The gateway's first-token
    timeout restarts on each, so a busy agent is waited for and only a silent (frozen) one
    fails over."""

    waited_s: float = 0.0
    waiting_for: str = "prefill"

    def to_json(self) -> dict[str, Any]:
        return {"type": "queued", "waited_s": self.waited_s, "waiting_for": self.waiting_for}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> QueuedEvent:
        waited = _float_or_none(raw.get("waited_s"))
        what = raw.get("waiting_for")
        return cls(
            waited if waited is not None and waited >= 0 else 0.0,
            what if isinstance(what, str) and what else "prefill",
        )


@dataclass(frozen=True, slots=True)
class OtherEvent:
    """An event type this reader does not know."""

    type: str
    raw: Mapping[str, Any]


StreamEvent = (
    TokenEvent
    | DoneEvent
    | ErrorEvent
    | ContinueEvent
    | ReadyEvent
    | ExtendedEvent
    | QueuedEvent
    | OtherEvent
)

_PARSERS: dict[str, Callable[[Mapping[str, Any]], StreamEvent]] = {
    "token": TokenEvent.from_json,
    "done": DoneEvent.from_json,
    "error": ErrorEvent.from_json,
    "continue": ContinueEvent.from_json,
    "ready": ReadyEvent.from_json,
    "extended": ExtendedEvent.from_json,
    "queued": QueuedEvent.from_json,
}


def parse_event(raw: Any) -> StreamEvent:
    """One decoded NDJSON line of a generate stream. ValueError when it is not an event."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("type"), str):
        raise ValueError(f"not a stream event: {raw!r:.200}")
    parser = _PARSERS.get(raw["type"])
    return parser(raw) if parser is not None else OtherEvent(raw["type"], raw)
