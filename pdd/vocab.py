"""PDD's vocabulary, defined once: pipelines, roles, handoff modes, link states.

Every part imports these (the routing policy, the gateway, the fleet's Django choices, the
agents' wire format, the planner); the values are the strings on the wire and in the
database. A ``StrEnum`` member is its string (``Pipeline.P_MD == "p-md"``, it hashes and
serialises to JSON as the string), so code and stored data compare directly."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Pipeline(StrEnum):
    """Which roles a request flows through."""

    CHOICES: ClassVar[tuple[Pipeline, ...]]  # set below: every member, in order
    P_MD = "p-md"  # high hit: the small KV delta goes straight over the WAN to MD
    P_RLD_MD = "p-rld-md"  # low hit: RLD decodes at once, hands off to MD when MD holds the KV
    RLD_ONLY = "rld-only"  # singular traffic or the no-MD fallback: RLD finishes, no WAN transfer
    # P-RLD finishes ordinary traffic on RLD. The policy never chooses it: it lets MD's cache
    # fall behind P's and the relay pool collapses. Only the simulator uses it, to show that.
    P_RLD = "p-rld"


class HandoffMode(StrEnum):
    """How RLD hands decoding to MD (only meaningful for P-RLD-MD)."""

    CHOICES: ClassVar[tuple[HandoffMode, ...]]  # set below: every member, in order
    ONE_SHOT = "one-shot"  # all generated token ids at once; RLD held the shortest
    CATCH_UP = "catch-up"  # batches while RLD keeps decoding; no stall, slightly more RLD load
    NONE = "none"


class Role(StrEnum):
    """An engine instance's role (the fleet's and the agents' name for it)."""

    CHOICES: ClassVar[tuple[Role, ...]]  # set below: every member, in order
    PREFILL = "prefill"
    RELAY_DECODE = "relay_decode"
    MAIN_DECODE = "main_decode"


class TokenRole(StrEnum):
    """Who produced a token, as the agents' token events say it."""

    CHOICES: ClassVar[tuple[TokenRole, ...]]  # set below: every member, in order
    PREFILL = "prefill"
    RLD = "rld"
    MD = "md"


ROLE_TOKENS = {
    Role.PREFILL: TokenRole.PREFILL,
    Role.RELAY_DECODE: TokenRole.RLD,
    Role.MAIN_DECODE: TokenRole.MD,
}


class InstanceStatus(StrEnum):
    """An engine instance's lifecycle as its agent runs and reports it (the state document);
    the control plane's stored state (fleet's ``ActualState``) is these plus its own
    ``pending`` (not placed on an agent yet) and ``unavailable`` (its agent went silent)."""

    CHOICES: ClassVar[tuple[InstanceStatus, ...]]  # set below: every member, in order
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPED = "stopped"
    FAILED = "failed"


class LinkStatus(StrEnum):
    CHOICES: ClassVar[tuple[LinkStatus, ...]]  # set below: every member, in order
    UP = "up"
    DEGRADED = "degraded"
    DOWN = "down"


# The pipelines a prefill agent runs (P_RLD is the simulator's only), the handoff modes RLD
# runs (NONE is the absence of a handoff), and every member, for the callers that list them.
AGENT_PIPELINES = (Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.RLD_ONLY)
AGENT_HANDOFF_MODES = (HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP)
# The older tuple spelling of every member, still used by the planner.
Pipeline.CHOICES = tuple(Pipeline)
HandoffMode.CHOICES = tuple(HandoffMode)
Role.CHOICES = tuple(Role)
TokenRole.CHOICES = tuple(TokenRole)
LinkStatus.CHOICES = tuple(LinkStatus)
InstanceStatus.CHOICES = tuple(InstanceStatus)
