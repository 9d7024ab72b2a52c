"""RLD's relay (agents/node/relay.py) in types: the request, the handoff's record, the phases
and their legal moves (`TRANSITIONS`, kept by `PhaseMachine` with the outbox of events), and
the typed items the session reacts to (`as_item` turns what the agent puts in an inbox into
one)."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agents.engine import SamplingParams, TokenOutput
from agents.node.wire import HandoffPlan, Peer, error_event
from agents.transfer.records import Transfer

log = logging.getLogger("agents.node.relay")  # the relay's own log, as before the split


@dataclass(slots=True)
class RelayRequest:
    request_id: str
    prompt: list[int]
    first_token: int
    sampling: SamplingParams
    main: Peer | None
    main_start_token: int
    plan: HandoffPlan
    # The caller reads the decoding role's stream itself (one hop per token): after the
    # handoff this stream ends with a `continue` naming MD's attach, instead of relaying MD.
    direct: bool = False


@dataclass
class Handoff:
    mode: str
    at_token: int | None = None  # index of the first token MD produced
    batches: int = 0
    completed: bool = False
    failed: str | None = None
    bytes: int = 0
    tokens_handed: int = 0
    batch_tokens: list[int] = field(default_factory=list)  # ids per batch sent, final last
    inflight: bool = False
    md_ready: bool = False
    slot_wait_s: float = 0.0  # how long MD waited for a decode slot before it was ready
    sent: list[asyncio.Task] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "at_token": self.at_token,
            "batches": self.batches,
            "completed": self.completed,
            "failed": self.failed,
            "tokens_handed": self.tokens_handed,
            "batch_tokens": list(self.batch_tokens),
            "slot_wait_s": self.slot_wait_s,
        }


# -- phases ------------------------------------------------------------------------------------


class Phase(enum.StrEnum):
    WAIT_KV = "wait_kv"  # MD's stream opened; waiting for P's full KV (other items kept)
    RELAY = "relay"  # RLD decodes and streams; MD gets ready, catch-up batches may fly
    FINAL = "final"  # final batch sent (cut at c): RLD's tokens buffered until MD's token c
    MAIN = "main"  # handoff acknowledged: RLD's request released, MD's tokens relayed (or
    # the stream ends with `continue` to MD's, for a direct caller)
    SOLO = "solo"  # handoff abandoned (MD or the WAN failed): RLD finishes the request
    DONE = "done"  # the last event (done or error) is out


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAIT_KV: frozenset({Phase.RELAY, Phase.DONE}),
    Phase.RELAY: frozenset({Phase.FINAL, Phase.SOLO, Phase.DONE}),
    Phase.FINAL: frozenset({Phase.MAIN, Phase.SOLO, Phase.DONE}),
    Phase.MAIN: frozenset({Phase.DONE}),
    Phase.SOLO: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


# -- queue items -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvArrived:
    """P's full KV landed in the inbox (transfer `<rid>|<instance>|kv`)."""

    transfer: Transfer


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A failure the agent put in the inbox: the request's cancel, a failed send (fail_inbox)
    or a transfer cut mid-way."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class RldOutput:
    """One engine step's output for the request on RLD."""

    out: TokenOutput


@dataclass(frozen=True, slots=True)
class RldFailed:
    """RLD's engine failed the request (a failed step, the instance stopping)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class MdEvent:
    """One NDJSON event of MD's held decode stream (ready, extended, token, done, error)."""

    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MdClosed:
    """MD's stream ended: None when it closed cleanly, else the failure (unreachable, HTTP
    error, broken stream)."""

    error: BaseException | None


@dataclass(frozen=True, slots=True)
class MdFailed:
    """The handoff failed on RLD's side: a batch's send failed, or no acknowledgement."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unexpected:
    """Any other inbox item (a transfer RLD does not take): ignored."""

    what: Any
    value: Any = None


RelayItem = (
    KvArrived | Cancelled | RldOutput | RldFailed | MdEvent | MdClosed | MdFailed | Unexpected
)
_ITEM_TYPES = (KvArrived, Cancelled, RldOutput, RldFailed, MdEvent, MdClosed, MdFailed, Unexpected)


def as_item(raw: Any) -> RelayItem:
    """What the agent puts in an inbox (`(what, transfer)` tuples, exceptions) as a typed item;
    the session's own items pass through."""
    if isinstance(raw, _ITEM_TYPES):
        return raw
    if isinstance(raw, BaseException):
        return Cancelled(raw)
    if isinstance(raw, tuple) and len(raw) == 2:
        what, value = raw
        if what == "kv":
            return KvArrived(value)
        return Unexpected(what, value)
    return Unexpected(raw)


# -- the phase machine -------------------------------------------------------------------------


class PhaseMachine:
    """A relayed request's phase, changed only through `to` (checked against TRANSITIONS), and
    its outbox of events for the caller, closed by the last one."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.phase = Phase.WAIT_KV
        self.outbox: deque[dict[str, Any]] = deque()

    def to(self, phase: Phase) -> bool:
        """Move to `phase` if TRANSITIONS allows it. An illegal move is a bug: it is logged,
        the request ends with an error event, and False says the caller must stop."""
        if phase in TRANSITIONS[self.phase]:
            self.phase = phase
            return True
        message = f"{self.rid}: relay bug: illegal transition {self.phase} -> {phase}"
        log.error(message)
        if self.phase is not Phase.DONE:
            self.outbox.append(error_event(message))
            self.phase = Phase.DONE
        return False

    def emit(self, event: dict[str, Any]) -> None:
        if self.phase is Phase.DONE:
            log.error("%s: relay bug: event after the end dropped: %r", self.rid, event)
            return
        self.outbox.append(event)

    def finish(self, event: dict[str, Any]) -> None:
        """Emit the last event (done or error) and end."""
        self.emit(event)
        self.to(Phase.DONE)

    def fail(self, message: str, code: str = "", role: str = "") -> None:
        """End with an error; ``role`` "md" when MD is what failed (the gateway blames it)."""
        self.finish(error_event(f"{self.rid}: {message}", code, role))
