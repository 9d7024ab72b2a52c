"""The PDD routing policy: plain data in (request, live-state snapshot, settings), a decision out.

The gateway, the planner's simulator and the tests all call :func:`decide`, so this module stays
pure: no Django, no I/O, no numpy. It picks the pipeline (P-MD, P-RLD-MD or RLD-only for
singular traffic), the handoff mode (one-shot or catch-up) and the P / RLD / MD instances, and
says why in a human-readable reason.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from pdd.checks import check_int, check_number
from pdd.vocab import HandoffMode, LinkStatus, Pipeline, Role


class Fallback:
    """What to do when a role a pipeline needs has no healthy instance."""

    RLD_ONLY = Pipeline.RLD_ONLY  # no MD path: RLD finishes the request
    P_MD = Pipeline.P_MD  # no RLD: send low-hit requests straight to MD anyway
    REJECT = "reject"  # raise NoHealthyPath


class NoHealthyPath(Exception):
    """No pipeline can serve the request with the instances that are healthy now."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PolicySettings:
    """Operator-tunable policy knobs; stored by the gateway as JSON (``to_dict``/``from_dict``).

    Relay rule: a request takes P-RLD-MD when its estimated WAN time exceeds
    ``wan_time_threshold_s`` or, if ``min_hit_rate`` is set, its hit rate is below it. At least
    one of the two must be set.

    Handoff rule (hysteresis from live state, so the policy itself stays stateless): the chosen
    RLD's load below ``rld_load_catch_up_below`` gives catch-up, at or above
    ``rld_load_one_shot_above`` gives one-shot, and in between the RLD keeps the mode it is
    running in (``InstanceState.handoff_mode``), catch-up if it has none.

    Full-MD rule (``relay_when_main_saturated``): when the chosen MD is full, its load at or
    above ``main_full_load`` (1.0: every decode slot taken or queued for; the choice prefers
    an unsaturated MD, so every reachable one is at least saturated), a request that would go
    straight to it relays instead, if the least-loaded RLD is below ``saturated_load``: the MD
    would queue it for a decode slot, and RLD decodes it meanwhile. RLD hands off when MD
    admits it, so the request still ends on MD (its cache stays aligned).

    Singular rule: prompt >= ``singular_min_prompt_tokens`` AND max_tokens <=
    ``singular_max_output_tokens`` AND hit rate < ``singular_max_hit_rate`` finishes on RLD.
    """

    wan_time_threshold_s: float | None = 1.0
    min_hit_rate: float | None = None
    catch_up_batch_tokens: int = 64
    rld_load_catch_up_below: float = 0.5
    rld_load_one_shot_above: float = 0.8
    singular_enabled: bool = True
    singular_min_prompt_tokens: int = 100_000
    singular_max_output_tokens: int = 16
    singular_max_hit_rate: float = 0.5
    fallback_no_main_decode: str = Fallback.RLD_ONLY
    fallback_no_relay: str = Fallback.P_MD
    # KV bytes per token of the served model; 4.4 KB is DeepSeek-V4-pro's compressed KV as
    # derived in docs/pdd.md (80 x 64K-token requests held ~23 GB).
    kv_bytes_per_token: int = 4_400
    # Instances at or above this load are skipped while a less loaded one exists.
    saturated_load: float = 0.95
    # P's prefix cache steers the P choice only where it saves a real share of the prefill: a
    # P's cached prefix counts when it covers at least this share of the prompt, so a session's
    # turns (90% and more cached) go back to the P that holds the context, while fresh prompts
    # that share only a system prompt go to the least loaded P. (With every hit counted, a P
    # started later never got a request: the first P held the system prompt, the new one not.)
    prefill_min_hit_share: float = 0.5
    # Relay a request whose MD is full (load >= main_full_load: it would wait there for a
    # decode slot) while an RLD below saturated_load can start it at once. See the full-MD rule.
    relay_when_main_saturated: bool = True
    # The chosen MD's load at which the full-MD rule relays: its slots are all taken (or
    # promised to requests on their way), so another request would queue there.
    main_full_load: float = 1.0
    # Floor on the share of a busy link a new transfer is assumed to get (TCP fairness gives it
    # at least some share), so the estimate stays finite at 100% utilisation.
    wan_min_share: float = 0.05
    # A degraded link is assumed to deliver this fraction of its nominal bandwidth.
    degraded_bandwidth_factor: float = 0.5
    # Stream P's sampled token to the user the moment prefill ends, ahead of the decoding
    # role. Off (the default), P's token leaves at the head of the decoding role's stream, so
    # TTFT counts the KV transfer that role waits for; on, TTFT is prefill time only and the
    # wait shows as a stall after the first token. Recorded per request (first_token_early).
    stream_first_token_early: bool = False

    def __post_init__(self) -> None:
        _check_optional_number(self, "wan_time_threshold_s", lo=0.0)
        _check_optional_number(self, "min_hit_rate", lo=0.0, hi=1.0)
        if self.wan_time_threshold_s is None and self.min_hit_rate is None:
            raise ValueError("wan_time_threshold_s: set it or min_hit_rate (both are None)")
        _check_int(self, "catch_up_batch_tokens", lo=1)
        _check_number(self, "rld_load_catch_up_below", lo=0.0)
        _check_number(self, "rld_load_one_shot_above", lo=0.0)
        if self.rld_load_catch_up_below > self.rld_load_one_shot_above:
            raise ValueError(
                "rld_load_catch_up_below: must be <= rld_load_one_shot_above "
                f"({self.rld_load_catch_up_below} > {self.rld_load_one_shot_above})"
            )
        for name in ("singular_enabled", "relay_when_main_saturated", "stream_first_token_early"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false")
        _check_int(self, "singular_min_prompt_tokens", lo=1)
        _check_int(self, "singular_max_output_tokens", lo=0)
        _check_number(self, "singular_max_hit_rate", lo=0.0, hi=1.0)
        if self.fallback_no_main_decode not in (Fallback.RLD_ONLY, Fallback.REJECT):
            raise ValueError(
                f"fallback_no_main_decode: must be {Fallback.RLD_ONLY!r} or {Fallback.REJECT!r}"
            )
        if self.fallback_no_relay not in (Fallback.P_MD, Fallback.REJECT):
            raise ValueError(f"fallback_no_relay: must be {Fallback.P_MD!r} or {Fallback.REJECT!r}")
        _check_int(self, "kv_bytes_per_token", lo=1)
        _check_number(self, "saturated_load", lo=0.0)
        _check_number(self, "prefill_min_hit_share", lo=0.0, hi=1.0)
        _check_number(self, "main_full_load", lo=0.0)
        _check_number(self, "wan_min_share", lo=1e-6, hi=1.0)
        _check_number(self, "degraded_bandwidth_factor", lo=1e-6, hi=1.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicySettings:
        """Build settings from JSON-like data; missing keys take defaults.

        Raises ValueError naming the offending field (unknown key, wrong type, out of range).
        """
        if not isinstance(data, Mapping):
            raise ValueError("settings: must be a mapping")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"{key}: unknown policy setting")
        try:
            return cls(**dict(data))
        except TypeError as exc:  # pragma: no cover - the key check above catches these
            raise ValueError(str(exc)) from exc


def _check_number(obj: object, name: str, lo: float | None = None, hi: float | None = None) -> None:
    check_number(getattr(obj, name), name, ge=lo, le=hi)


def _check_optional_number(
    obj: object, name: str, lo: float | None = None, hi: float | None = None
) -> None:
    if getattr(obj, name) is not None:
        _check_number(obj, name, lo, hi)


def _check_int(obj: object, name: str, lo: int | None = None) -> None:
    check_int(getattr(obj, name), name, ge=lo)


# ---------------------------------------------------------------------------------------------
# Live state
# ---------------------------------------------------------------------------------------------


class BlockSet(Protocol):
    """Prefix-block hashes an instance holds, as the policy reads them: a frozenset, or the
    prefix index's view of a main decoder's cache (fleet.kv_index.HeldBlocks)."""

    def __contains__(self, item: object, /) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]: ...

    def union(self, *others: Iterable[str]) -> BlockSet: ...


@dataclass(slots=True)
class InstanceState:
    """One engine instance as the policy sees it. Mutable so a simulator can update it in place.

    ``load`` is the fraction of capacity in use (running / capacity; may exceed 1 when queued).
    ``cached_prefix_blocks`` is the set of prefix-block hashes the instance's prefix cache holds
    (the DRC on MD); a request's hit is the longest leading run of its hashes found there.
    ``handoff_mode`` is the mode an RLD is running in now (for hysteresis), if any.
    """

    id: str
    role: str
    datacenter: str = ""
    healthy: bool = True
    load: float = 0.0
    queue_depth: int = 0
    cached_prefix_blocks: BlockSet = field(default_factory=frozenset)
    handoff_mode: str | None = None
    # Tokens per block of this instance's prefix cache (an MD's own engine block size), when
    # it differs from the served model's: its ``cached_prefix_blocks`` are hashes of blocks
    # of this size, matched against the request's hashes of the same size. 0: the model's.
    block_tokens: int = 0


@dataclass(slots=True)
class WanLinkState:
    """The WAN link from the prefill datacenter to one MD datacenter."""

    bandwidth_gbps: float
    rtt_ms: float
    utilisation: float = 0.0  # fraction of bandwidth in use by other transfers, 0..1
    status: str = LinkStatus.UP
    # What one transfer's connection can reach on its own (a TCP stream over a long RTT is
    # window-limited, far below the line rate); None when the line rate is reachable.
    per_connection_gbps: float | None = None
    # Expected seconds a new transfer waits for a free connection of the sender's bounded
    # connection pool before its first byte moves (0 while a connection is free). Utilisation
    # cannot show this: a full pool of window-limited connections may use only part of the
    # line, and the min-share floor sits above the per-connection cap, so without it a queue
    # for connections is invisible to the estimate.
    pool_wait_s: float = 0.0
    # Bytes on the wire per byte of KV as the engines hold it (PolicySettings.kv_bytes_per_token):
    # the link's transport format (pdd/kv_formats.py), e.g. ~0.5 for bfloat16 KV sent as int8.
    wire_factor: float = 1.0

    def available_bytes_per_s(self, settings: PolicySettings) -> float:
        share = max(1.0 - self.utilisation, settings.wan_min_share)
        if self.status == LinkStatus.DEGRADED:
            share *= settings.degraded_bandwidth_factor
        gbps = self.bandwidth_gbps * share
        if self.per_connection_gbps is not None:
            gbps = min(gbps, self.per_connection_gbps)
        return gbps * 1e9 / 8.0


@dataclass(slots=True)
class RequestInfo:
    """What the policy needs to know about one request."""

    prompt_tokens: int
    max_tokens: int
    prefix_block_hashes: tuple[str, ...] = ()
    block_tokens: int = 64  # tokens per prefix block; must match the agents' cache hashing
    # The prompt's hashes in blocks of other sizes (block size -> hashes), for instances whose
    # cache hashes blocks of another size (InstanceState.block_tokens).
    hashes_by_block: Mapping[int, tuple[str, ...]] = field(default_factory=dict)

    def hashes_for(self, instance: InstanceState) -> tuple[tuple[str, ...], int]:
        """The prompt's prefix hashes in the instance's block size, and that size: its own
        when it differs from the request's and they were computed, else the request's."""
        size = instance.block_tokens
        if size and size != self.block_tokens:
            other = self.hashes_by_block.get(size)
            if other is not None:
                return other, size
        return self.prefix_block_hashes, self.block_tokens


@dataclass(slots=True)
class ClusterSnapshot:
    """Live state for one decision: healthy-or-not instances per role and the WAN links.

    ``wan_links`` is keyed by MD datacenter. ``prefix_hits`` optionally gives, per MD id, how
    many of this request's prompt tokens that MD already holds, when the caller has measured it
    (a cache index, the simulator); otherwise the policy matches ``prefix_block_hashes``.
    """

    prefill: tuple[InstanceState, ...] = ()
    relay_decode: tuple[InstanceState, ...] = ()
    main_decode: tuple[InstanceState, ...] = ()
    wan_links: Mapping[str, WanLinkState] = field(default_factory=dict)
    prefix_hits: Mapping[str, int] | None = None

    @classmethod
    def from_instances(
        cls,
        instances: Iterable[InstanceState],
        wan_links: Mapping[str, WanLinkState],
        prefix_hits: Mapping[str, int] | None = None,
    ) -> ClusterSnapshot:
        by_role: dict[str, list[InstanceState]] = {r: [] for r in Role.CHOICES}
        for inst in instances:
            if inst.role not in by_role:
                raise ValueError(f"role: unknown role {inst.role!r} on instance {inst.id!r}")
            by_role[inst.role].append(inst)
        return cls(
            prefill=tuple(by_role[Role.PREFILL]),
            relay_decode=tuple(by_role[Role.RELAY_DECODE]),
            main_decode=tuple(by_role[Role.MAIN_DECODE]),
            wan_links=wan_links,
            prefix_hits=prefix_hits,
        )


@dataclass(slots=True)
class Decision:
    pipeline: str
    handoff_mode: str
    prefill_id: str
    relay_id: str | None
    main_id: str | None
    cached_tokens: int
    delta_tokens: int
    est_wan_s: float | None
    reason: str
    catch_up_batch: int = 0
    fallback: bool = False

    @property
    def hit_rate(self) -> float:
        total = self.cached_tokens + self.delta_tokens
        return self.cached_tokens / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Decision
# ---------------------------------------------------------------------------------------------


def leading_run(block_hashes: Sequence[str], held: Collection[str]) -> int:
    """How many of ``block_hashes``, from the first, ``held`` has, in O(log n) lookups.

    ``block_hashes`` are chain hashes (block k's hash covers every token before it) and
    ``held`` is prefix-closed: a radix cache holds a block only with every block before it,
    and the KV in flight to an MD is whole prompt prefixes. So "block k is held" is true up to
    the run's end and false after it, and a binary search over k finds the end."""
    n = len(block_hashes)
    if not n or not held or block_hashes[0] not in held:  # a miss: most MDs, one lookup
        return 0
    if block_hashes[n - 1] in held:  # the whole prompt is held
        return n
    lo, hi = 0, n - 1  # the first lo blocks are held; block hi is not
    while lo < hi:
        mid = (lo + hi + 1) // 2  # is block mid - 1 held (so the first mid are)?
        if block_hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefix_hit_tokens(request: RequestInfo, instance: InstanceState) -> int:
    """Prompt tokens covered by the longest leading run of the request's blocks the cache holds."""
    hashes, block_tokens = request.hashes_for(instance)
    hit_blocks = leading_run(hashes, instance.cached_prefix_blocks)
    return min(hit_blocks * block_tokens, request.prompt_tokens)


def estimate_wan_s(delta_tokens: int, link: WanLinkState, settings: PolicySettings) -> float:
    """Expected seconds until MD holds the delta's KV.

    The wait for a pool connection (``link.pool_wait_s``, 0 when one is free; negative or NaN
    values count as 0) plus one RTT plus the delta's bytes over the bandwidth left by the
    link's current use. With no pool wait this is exactly the RTT-plus-bytes estimate. The
    delta's bytes are those its transport format puts on the wire (``link.wire_factor``).
    """
    delta_bytes = delta_tokens * settings.kv_bytes_per_token * link.wire_factor
    wait = link.pool_wait_s if link.pool_wait_s > 0.0 else 0.0
    return wait + link.rtt_ms / 1000.0 + delta_bytes / link.available_bytes_per_s(settings)


def _first_in_order(
    candidates: Iterable[InstanceState],
    saturated: float,
    hits: Mapping[str, int] | None = None,
    datacenters: Collection[str] | None = None,
) -> InstanceState | None:
    """The healthy candidate first in (saturated, -hit, load, queue depth, id) order, or None.

    ``hits`` gives cached prefix tokens by instance id (0 where missing, all 0 without it);
    ``datacenters``, if given, restricts the candidates to those datacenters. Compared field by
    field rather than as key tuples: the simulator decides ~300k times per simulated hour over
    tens of instances, and the order is the same.
    """
    best: InstanceState | None = None
    best_sat = False
    best_hit = 0
    best_load = 0.0
    for inst in candidates:
        if not inst.healthy:
            continue
        if datacenters is not None and inst.datacenter not in datacenters:
            continue
        hit = hits.get(inst.id, 0) if hits is not None else 0
        load = inst.load
        sat = load >= saturated
        if best is not None:
            if sat != best_sat:
                if sat:
                    continue
            elif hit != best_hit:
                if hit < best_hit:
                    continue
            elif load != best_load:
                if not load < best_load:
                    continue
            elif (inst.queue_depth, inst.id) >= (best.queue_depth, best.id):
                continue
        best, best_sat, best_hit, best_load = inst, sat, hit, load
    return best


def _least_loaded(candidates: Iterable[InstanceState], saturated: float) -> InstanceState | None:
    """Least-loaded healthy instance, unsaturated ones first (queue depth, then id, break ties)."""
    return _first_in_order(candidates, saturated)


def _choose_prefill(
    request: RequestInfo, snapshot: ClusterSnapshot, settings: PolicySettings
) -> InstanceState | None:
    """Cache-aware P choice where P's prefix caches are known (the prefix index): the longest
    cached prefix among unsaturated Ps, load breaks ties, so a session's turns return to the P
    that holds its context and P computes only the new tokens; least loaded otherwise. A
    cached prefix shorter than ``prefill_min_hit_share`` of the prompt does not count."""
    if not any(inst.cached_prefix_blocks for inst in snapshot.prefill if inst.healthy):
        return _least_loaded(snapshot.prefill, settings.saturated_load)
    floor = settings.prefill_min_hit_share * request.prompt_tokens
    hits = {}
    for inst in snapshot.prefill:
        if inst.healthy:
            hit = prefix_hit_tokens(request, inst)
            hits[inst.id] = hit if hit >= floor else 0
    return _first_in_order(snapshot.prefill, settings.saturated_load, hits)


def _choose_main_decode(
    request: RequestInfo, snapshot: ClusterSnapshot, settings: PolicySettings
) -> tuple[InstanceState | None, int, WanLinkState | None]:
    """Cache-aware MD choice: longest cached prefix among unsaturated MDs, load breaks ties.

    Only MDs whose WAN link is known and not down are candidates (no path to the others).
    """
    links = snapshot.wan_links
    reachable = {dc for dc, link in links.items() if link.status != LinkStatus.DOWN}
    hits = snapshot.prefix_hits
    if hits is None:
        hits = {
            inst.id: prefix_hit_tokens(request, inst)
            for inst in snapshot.main_decode
            if inst.healthy and inst.datacenter in reachable
        }
    best = _first_in_order(snapshot.main_decode, settings.saturated_load, hits, reachable)
    if best is None:
        return None, 0, None
    return best, min(hits.get(best.id, 0), request.prompt_tokens), links[best.datacenter]


def _handoff_mode(relay: InstanceState, settings: PolicySettings) -> tuple[str, str]:
    load = relay.load
    if load < settings.rld_load_catch_up_below:
        return HandoffMode.CATCH_UP, f"RLD load {load:.2f} < {settings.rld_load_catch_up_below}"
    if load >= settings.rld_load_one_shot_above:
        return HandoffMode.ONE_SHOT, f"RLD load {load:.2f} >= {settings.rld_load_one_shot_above}"
    current = relay.handoff_mode
    mode = current if current in (HandoffMode.CATCH_UP, HandoffMode.ONE_SHOT) else None
    mode = mode or HandoffMode.CATCH_UP
    return mode, f"RLD load {load:.2f} in hysteresis band, keeps {mode}"


def decide(request: RequestInfo, snapshot: ClusterSnapshot, settings: PolicySettings) -> Decision:
    """Choose pipeline, handoff mode and instances for one request.

    Never returns ``Pipeline.P_RLD``. Raises :class:`NoHealthyPath` when no P is healthy, when
    neither an RLD nor an MD path is, or when a fallback the settings reject would be needed.
    """
    prefill = _choose_prefill(request, snapshot, settings)
    if prefill is None:
        raise NoHealthyPath("no healthy prefill instance")
    relay = _least_loaded(snapshot.relay_decode, settings.saturated_load)
    main, cached, link = _choose_main_decode(request, snapshot, settings)
    prompt = request.prompt_tokens
    delta = prompt - cached
    hit_rate = cached / prompt if prompt > 0 else 1.0

    if main is None or link is None:
        if relay is None:
            raise NoHealthyPath("no healthy relay decode and no reachable main decode")
        if settings.fallback_no_main_decode == Fallback.REJECT:
            raise NoHealthyPath("no reachable main decode and fallback is reject")
        return Decision(
            pipeline=Pipeline.RLD_ONLY,
            handoff_mode=HandoffMode.NONE,
            prefill_id=prefill.id,
            relay_id=relay.id,
            main_id=None,
            cached_tokens=0,
            delta_tokens=prompt,
            est_wan_s=None,
            reason="fallback: no healthy main decode with a WAN link up; relay decode finishes",
            fallback=True,
        )

    est_wan_s = estimate_wan_s(delta, link, settings)

    if (
        settings.singular_enabled
        and relay is not None
        and prompt >= settings.singular_min_prompt_tokens
        and request.max_tokens <= settings.singular_max_output_tokens
        and hit_rate < settings.singular_max_hit_rate
    ):
        return Decision(
            pipeline=Pipeline.RLD_ONLY,
            handoff_mode=HandoffMode.NONE,
            prefill_id=prefill.id,
            relay_id=relay.id,
            main_id=None,
            cached_tokens=cached,
            delta_tokens=delta,
            est_wan_s=est_wan_s,
            reason=(
                f"singular traffic: prompt {prompt} tokens, max_tokens {request.max_tokens}, "
                f"hit {hit_rate:.1%}; WAN transfer ({est_wan_s:.2f} s) cut, relay decode finishes"
            ),
        )

    threshold = settings.wan_time_threshold_s
    min_hit = settings.min_hit_rate
    slow_wan = threshold is not None and est_wan_s > threshold
    low_hit = min_hit is not None and hit_rate < min_hit
    main_full = (
        settings.relay_when_main_saturated
        and main.load >= settings.main_full_load
        and relay is not None
        and relay.load < settings.saturated_load
    )
    if not (slow_wan or low_hit or main_full):
        return Decision(
            pipeline=Pipeline.P_MD,
            handoff_mode=HandoffMode.NONE,
            prefill_id=prefill.id,
            relay_id=None,
            main_id=main.id,
            cached_tokens=cached,
            delta_tokens=delta,
            est_wan_s=est_wan_s,
            reason=f"high hit {hit_rate:.1%}: est WAN {est_wan_s:.3f} s for {delta} delta tokens",
        )

    label, how = "low hit", "relay decodes while the delta crosses"
    if slow_wan:
        why = f"est WAN {est_wan_s:.3f} s > {threshold} s"
    elif low_hit:
        why = f"hit {hit_rate:.1%} < {min_hit:.1%}"
    else:
        why = f"MD {main.id} full (load {main.load:.2f} >= {settings.main_full_load})"
        label, how = "hit", "relay decodes until MD has a slot"
    if relay is None:
        if settings.fallback_no_relay == Fallback.REJECT:
            raise NoHealthyPath(f"low hit ({why}) needs a relay decode; none healthy")
        return Decision(
            pipeline=Pipeline.P_MD,
            handoff_mode=HandoffMode.NONE,
            prefill_id=prefill.id,
            relay_id=None,
            main_id=main.id,
            cached_tokens=cached,
            delta_tokens=delta,
            est_wan_s=est_wan_s,
            reason=f"fallback: low hit ({why}) but no healthy relay decode; straight to MD",
            fallback=True,
        )

    mode, mode_why = _handoff_mode(relay, settings)
    batch = settings.catch_up_batch_tokens if mode == HandoffMode.CATCH_UP else 0
    return Decision(
        pipeline=Pipeline.P_RLD_MD,
        handoff_mode=mode,
        prefill_id=prefill.id,
        relay_id=relay.id,
        main_id=main.id,
        cached_tokens=cached,
        delta_tokens=delta,
        est_wan_s=est_wan_s,
        reason=f"{label} {hit_rate:.1%}: {why}; {how}; {mode_why} -> {mode}",
        catch_up_batch=batch,
    )
