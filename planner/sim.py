"""The discrete-event simulator of a PDD fleet (and its baselines) replaying one trace.

Every request flows: arrival -> routing decision -> prefill on P -> KV transfer (intra-DC
fabric and/or WAN) -> decode on RLD and/or MD, with the extend-decode handoff between them.
Routing for every system goes through ``pdd.policy.decide``: PDD as configured, CDC-PD with
no relay pool, IDC-PD over a local "link", P-RLD by finishing P-RLD-MD decisions on RLD.

Agent sessions run in a closed loop when the trace says so (a turn waits for the previous
response). A routed request counts in its decode instance's load until its KV arrives. MD's
prefix match can count KV already on its way to it (``fleet.drc_counts_in_flight``) in what P
sends, while the decision sees only the KV MD's cache holds, as the live gateway's heartbeats
report it (``fleet.decision_counts_in_flight`` off), and a relayed request's KV for MD can yield
the WAN connection queue (``fleet.relay_transfers_yield``).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from pdd import policy as routing_policy
from pdd.hardware import kv_capacity_tokens
from pdd.policy import (
    ClusterSnapshot,
    HandoffMode,
    InstanceState,
    NoHealthyPath,
    Pipeline,
    RequestInfo,
    Role,
    WanLinkState,
)
from planner.events import EventLoop
from planner.fleet import FleetSpec, Handoff, System, session_home
from planner.host import Host, HostedDecode, HostedPrefill, HostWork
from planner.instances import DecodeInstance, PrefillInstance
from planner.wan import WanLink

PIPELINE_CODES: dict[str, int] = {p: i for i, p in enumerate(Pipeline.CHOICES)}
NO_PIPELINE = -1
P_MD, P_RLD_MD = PIPELINE_CODES[Pipeline.P_MD], PIPELINE_CODES[Pipeline.P_RLD_MD]


@dataclass(slots=True)
class RunRecord:
    """Per-request outcomes (NaN where a stage did not happen) and time series."""

    arrival_s: np.ndarray  # when each request was sent (NaN: never, its predecessor never ended)
    ttft_s: np.ndarray
    finish_s: np.ndarray
    wan_s: np.ndarray
    wan_wait_s: np.ndarray
    pipeline: np.ndarray
    handoff: np.ndarray  # 1 one-shot, 2 catch-up, 0 none
    rld_tokens: np.ndarray
    md_tokens: np.ndarray
    md_hit_tokens: np.ndarray
    md_kv_at_s: np.ndarray  # when MD could use the request's KV (after what it builds on landed)
    # Where a first token's time went: when P finished the prompt, when the KV was usable on the
    # decode instance that gave the first token (RLD, or MD), and when that instance admitted
    # the request (a decode slot and KV memory free). NaN where it never happened.
    prefill_done_s: np.ndarray
    first_kv_s: np.ndarray
    first_start_s: np.ndarray
    # The trace's drawn arrival times: they set the measured window and the offered rate (a
    # closed-loop turn may be sent later than drawn, see ``Trace.closed_loop``).
    drawn_arrival_s: np.ndarray
    input_tokens: np.ndarray
    cached_tokens: np.ndarray  # the trace's prefix hits on P: billed as cached input
    output_tokens: np.ndarray
    series: dict[str, list[float]] = field(default_factory=dict)
    decisions: int = 0
    prefill_busy_s: float = 0.0
    pool_utilisation: float = 0.0
    link_utilisation: float = 0.0
    sim_end_s: float = 0.0
    # Set when the run stopped early because its SLA could not be met any more (Simulator.run's
    # stop_on_miss): the simulated time it stopped at; the figures are then partial.
    stopped_at_s: float | None = None
    # On a shared host (``fleet.host``): CPU seconds each task used (instance ids, "gateway").
    host_cpu_s: dict[str, float] = field(default_factory=dict)


class Simulator:
    def __init__(self, fleet: FleetSpec, sample_every_s: float = 10.0) -> None:
        self.fleet = fleet
        self.sample_every_s = sample_every_s
        self.loop = EventLoop()
        model, engine = fleet.model, fleet.engine
        settings = replace(fleet.policy, kv_bytes_per_token=model.kv_bytes_per_token)
        if fleet.handoff == Handoff.ONE_SHOT:
            settings = replace(settings, rld_load_catch_up_below=0.0, rld_load_one_shot_above=0.0)
        elif fleet.handoff == Handoff.CATCH_UP:
            settings = replace(settings, rld_load_catch_up_below=1e9, rld_load_one_shot_above=1e9)
        self.settings = settings
        self.prefill: dict[str, PrefillInstance] = {}
        self.relay: dict[str, DecodeInstance] = {}
        self.main: dict[str, DecodeInstance] = {}
        cache_tokens = int(fleet.drc_capacity_gb * 1e9 / model.kv_bytes_per_token)
        # session -> the MDs that may hold its context: the router looks at those only.
        self._holders: dict[int, dict[str, DecodeInstance]] = {}
        # A shared machine (``fleet.host``): every instance's work is stretched while the busy
        # tasks outnumber its cores; the gateway's per-request CPU is one more task.
        self.host = host = Host(fleet.host, self.loop) if fleet.host is not None else None
        for pool in fleet.pools:
            gpu = fleet.gpu_types[pool.gpu]
            role = pool.role
            if fleet.system == System.IDC_PD and role == Role.RELAY_DECODE:
                continue  # IDC-PD has no relay; its decode pool is main_decode in DC A
            if fleet.system == System.CDC_PD and role == Role.RELAY_DECODE:
                continue
            for k in range(pool.count):
                state = InstanceState(
                    f"{role}-{pool.datacenter}-{pool.gpu}-{k}", role, pool.datacenter
                )
                if role == Role.PREFILL:
                    args = (state, gpu, model, engine, self.loop)
                    self.prefill[state.id] = (
                        PrefillInstance(*args) if host is None else HostedPrefill(*args, host=host)
                    )
                else:
                    kv_cap = kv_capacity_tokens(model, gpu, fleet.resident_weight_gb)
                    is_main = role == Role.MAIN_DECODE
                    d_args = (
                        state, gpu, model, engine, self.loop, kv_cap,
                        cache_tokens if is_main else 0, self._holders if is_main else None,
                    )  # fmt: skip
                    inst = (
                        DecodeInstance(*d_args)
                        if host is None
                        else HostedDecode(*d_args, host=host)
                    )
                    (self.relay if role == Role.RELAY_DECODE else self.main)[state.id] = inst
        self._gateway: HostWork | None = None
        self._request_cpu_s = 0.0
        if host is not None and fleet.host is not None and fleet.host.request_cpu_s > 0:
            self._gateway = HostWork(host, "gateway")
            self._request_cpu_s = fleet.host.request_cpu_s
        self.idc = fleet.system == System.IDC_PD
        self.links: dict[str, WanLink] = {}
        link_states: dict[str, WanLinkState] = {}
        if self.idc:
            # The "link" to a local decode pool is the RDMA fabric: never the bottleneck here.
            for inst in self.main.values():
                link_states[inst.state.datacenter] = WanLinkState(1e4, fleet.fabric.latency_ms)
        else:
            for dc, spec in fleet.links.items():
                self.links[dc] = WanLink(spec, self.loop)
                link_states[dc] = WanLinkState(
                    spec.bandwidth_gbps,
                    spec.rtt_ms,
                    per_connection_gbps=spec.connection_gbps,
                    wire_factor=spec.wire_factor,
                )
        self.link_states = link_states
        self.snapshot = ClusterSnapshot(
            prefill=tuple(p.state for p in self.prefill.values()),
            relay_decode=tuple(r.state for r in self.relay.values()),
            main_decode=tuple(m.state for m in self.main.values()),
            wan_links=link_states,
            prefix_hits={},
        )
        self._main_list = list(self.main.values())
        self._snap = ClusterSnapshot(wan_links=link_states)
        self._request = RequestInfo(prompt_tokens=1, max_tokens=1)
        # Settings read on every request, looked up once.
        self._kv_bytes = model.kv_bytes_per_token
        self._yield = fleet.relay_transfers_yield
        self._fabric_terms: dict[tuple[float, float], tuple[float, float]] = {}
        # A relay's handoff priced apart (FabricSpec.relay_*), whatever the chips: its terms.
        fabric = fleet.fabric
        self._relay_fabric: tuple[float, float] | None = None
        if fabric.relay_gbps is not None:
            latency_ms = (
                fabric.latency_ms if fabric.relay_latency_ms is None else fabric.relay_latency_ms
            )
            self._relay_fabric = (latency_ms / 1000.0, fabric.relay_gbps * 1e9)
        self._p_rld = fleet.system == System.P_RLD
        self._drc_in_flight = fleet.drc_counts_in_flight
        self._decision_in_flight = fleet.decision_counts_in_flight
        # fleet.prefill_affinity: the P holding each session's context (``_affine_prefill``).
        self._p_affinity = fleet.prefill_affinity
        self._p_keys = list(self.prefill)
        self._home_salt = fleet.session_home_salt
        self._p_home: dict[int, str] = {}
        # A live P's load is its requests over its slots (the engine's max_running, which the
        # emulated engine takes from max_decode_batch); saturated at the policy's threshold.
        self._p_saturated = settings.saturated_load * fleet.engine.max_decode_batch
        self._shared = 0
        self._pool_wait_aware = fleet.pool_wait_aware
        self._link_pairs = [(link, link_states[dc]) for dc, link in self.links.items()]
        # Each role's instances in id order, with their (load, queue depth) in a parallel list
        # the instances keep current: the candidates the policy can pick are found from these.
        self._prefill_by_id = _rank(list(self.prefill.values()), lambda p: p.state.load)
        self._relay_by_id = _rank(list(self.relay.values()), _decode_key)
        self._main_by_id = _rank(self._main_list, _decode_key)
        self.check_decisions = False

    # --- run ------------------------------------------------------------------------------------
    def run(
        self,
        trace,
        drain_s: float | None = None,
        stop_on_miss: tuple[float, float, float] | None = None,
    ) -> RunRecord:
        """Replay ``trace``. ``stop_on_miss`` = (window start, P90 bound, P99 bound): stop as
        soon as the TTFT SLA over the requests drawn from the window start is certain to fail
        (``_check_miss``); the record then says when (``stopped_at_s``)."""
        n = len(trace)
        self.arr = trace.arrival_s.tolist()
        self.n_in = trace.input_tokens.tolist()
        self.cached = trace.cached_tokens.tolist()
        self.n_out = trace.output_tokens.tolist()
        self.session = trace.session_id.tolist()
        # Closed-loop sessions: a turn is sent at its drawn time or when its predecessor's
        # response ends, whichever is later (``_send_next_turn``).
        self.next_turn = [-1] * n
        self.waiting_turn = [False] * n
        if trace.closed_loop:
            for i, j in enumerate(trace.previous_turn().tolist()):
                if j >= 0:
                    self.next_turn[j] = i
                    self.waiting_turn[i] = True
        nan = float("nan")
        self.ttft = [nan] * n
        self.finish = [nan] * n
        self.wan_s = [nan] * n
        self.wan_wait = [nan] * n
        self.md_kv_at = [nan] * n
        self.prefill_done = [nan] * n
        self.relay_kv_at = [nan] * n
        self.first_kv = [nan] * n
        self.first_start = [nan] * n
        self.pipe = [NO_PIPELINE] * n
        self.mode = [0] * n
        self.rld_tokens = [0] * n
        self.md_tokens = [0] * n
        self.md_hit = [0] * n
        self.route: list[tuple[str, str | None, str | None]] = [("", None, None)] * n
        self._route_obj: list[tuple] = [(None, None, None)] * n  # the same, as instances
        # Tokens a request holds on a decode instance (``_ctx``).
        self.ctx = (trace.input_tokens + trace.output_tokens // 2).tolist()
        self.rld_start = [nan] * n
        self.rld_job = [0.0] * n
        self.handed = [False] * n
        self.md_took_all = [False] * n
        self.seen_sessions: set[int] = set()
        self._p_home = {}
        self._shared = trace.shared_prefix_tokens
        self.appended: dict[int, int] = {}
        self.version = [0] * n
        self.depends: dict[int, int] = {}  # request -> in-flight version its MD must land first
        keys = ("t", "rld_load", "md_load", "wan_util", "pool_util", "md_hit_rate")
        self.series: dict[str, list[float]] = {k: [] for k in keys}
        self._window_hits = [0, 0]
        last = self.arr[-1] if n else 0.0
        self._last_arrival = last
        # The arrivals are the loop's stream (ahead of any other event at the same time, as if
        # scheduled first), in the order of (drawn time, index).
        times = list(self.arr)
        order = list(range(n))
        if n and bool(np.any(np.diff(trace.arrival_s) < 0)):
            order.sort(key=times.__getitem__)  # stable: ties keep index order
            times = [times[i] for i in order]
        self.loop.at(0.0, self._sample)
        # Link utilisation is measured over the arrival window, not the drain after it.
        self._link_window: tuple[float, list[tuple[float, float]]] | None = None
        self.loop.at(last, self._close_link_window)
        drain = drain_s if drain_s is not None else max(600.0, last)
        self.stopped_at_s: float | None = None
        if stop_on_miss is not None:
            self._plan_miss_checks(trace, *stop_on_miss)
        # The run makes few reference cycles but millions of short-lived containers, over
        # which the cyclic collector would keep walking the run's growing state: off meanwhile.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run(until=last + drain, stream=(times, order, self._arrive))
        except _SlaMissed:
            self.stopped_at_s = self.loop.now
        finally:
            if collecting:
                gc.enable()
        return self._record(trace)

    # --- stopping a run whose SLA cannot be met -------------------------------------------------
    # The SLA holds when P90 and P99 TTFT over the window's requests (drawn at or after its
    # start; never served = inf) are below their bounds. np.percentile's q-th value of N sorted
    # values lies between the values at floor(h) and floor(h) + 1, h = (N - 1) q / 100: once
    # N - floor(h) + 1 of the window's TTFTs are certain to reach the bound (one spare for the
    # rounding of h), so is the percentile, whatever the rest do. A TTFT is certain to reach B
    # once it is known and >= B, or once its request was sent at least B ago without a first
    # token. Checked every ``sample_every_s`` (simulated) from the window start + the P90 bound;
    # a check only reads state, so a run that is not stopped is the same run.
    def _plan_miss_checks(self, trace, start_s: float, p90_s: float, p99_s: float) -> None:
        drawn = trace.arrival_s
        if len(drawn) and bool(np.any(np.diff(drawn) < 0)):
            return  # the window is not a slice of the requests: no early stop
        w0 = int(np.searchsorted(drawn, start_s, side="left"))
        n = len(drawn) - w0
        if n <= 0:
            return
        margin = 1.0 + 1e-9  # a count at the bound itself is not needed; above it is safe
        self._miss = (
            w0,
            [(p90_s * margin, n - math.floor((n - 1) * 0.90) + 1),
             (p99_s * margin, n - math.floor((n - 1) * 0.99) + 1)],
        )  # fmt: skip
        self.loop.at(start_s + min(p90_s, p99_s), self._check_miss)

    def _check_miss(self) -> None:
        w0, bounds = self._miss
        now = self.loop.now
        ttft = np.array(self.ttft[w0:])
        sent = np.array(self.arr[w0:])
        pending = np.isnan(ttft)
        for bound, needed in bounds:
            certain = int(np.count_nonzero(ttft >= bound)) + int(
                np.count_nonzero(pending & (sent <= now - bound))
            )
            if certain >= needed:
                raise _SlaMissed
        if self.loop._heap or now < self._last_arrival:
            self.loop.at(now + self.sample_every_s, self._check_miss)

    def _close_link_window(self) -> None:
        self._link_window = (self.loop.now, [ln.totals() for ln in self.links.values()])

    def _record(self, trace) -> RunRecord:
        links = list(self.links.values())
        end = self.loop.now or 1.0
        if self._link_window is not None and self._link_window[0] > 0:
            window, totals = self._link_window
        else:
            window, totals = end, [ln.totals() for ln in links]
        return RunRecord(
            arrival_s=np.array(self.arr),
            ttft_s=np.array(self.ttft),
            finish_s=np.array(self.finish),
            wan_s=np.array(self.wan_s),
            wan_wait_s=np.array(self.wan_wait),
            pipeline=np.array(self.pipe),
            handoff=np.array(self.mode),
            rld_tokens=np.array(self.rld_tokens),
            md_tokens=np.array(self.md_tokens),
            md_hit_tokens=np.array(self.md_hit),
            md_kv_at_s=np.array(self.md_kv_at),
            prefill_done_s=np.array(self.prefill_done),
            first_kv_s=np.array(self.first_kv),
            first_start_s=np.array(self.first_start),
            drawn_arrival_s=trace.arrival_s,
            input_tokens=trace.input_tokens,
            cached_tokens=trace.cached_tokens,
            output_tokens=trace.output_tokens,
            series=self.series,
            decisions=sum(1 for p in self.pipe if p != NO_PIPELINE),
            prefill_busy_s=sum(p.busy_s for p in self.prefill.values()),
            pool_utilisation=(
                float(np.mean([busy / window for busy, _ in totals])) if links else 0.0
            ),
            link_utilisation=(
                float(
                    np.mean(
                        [
                            sent / (ln.capacity * window)
                            for ln, (_, sent) in zip(links, totals, strict=True)
                        ]
                    )
                )
                if links
                else 0.0
            ),
            sim_end_s=end,
            stopped_at_s=self.stopped_at_s,
            host_cpu_s=self.host.cpu_seconds() if self.host is not None else {},
        )

    def _sample(self) -> None:
        s = self.series
        s["t"].append(self.loop.now)
        relay = list(self.relay.values())
        cap = self.fleet.engine.max_decode_batch
        s["rld_load"].append(
            sum(r.running + len(r.queue) for r in relay) / (cap * len(relay)) if relay else 0.0
        )
        s["md_load"].append(
            sum(m.running + len(m.queue) for m in self._main_list) / (cap * len(self._main_list))
        )
        links = list(self.links.values())
        s["wan_util"].append(float(np.mean([ln.utilisation for ln in links])) if links else 0.0)
        s["pool_util"].append(
            float(np.mean([ln.pool_utilisation for ln in links])) if links else 0.0
        )
        hit, total = self._window_hits
        s["md_hit_rate"].append(hit / total if total else float("nan"))
        self._window_hits = [0, 0]
        if self.loop.now < self._last_arrival:
            self.loop.at(self.loop.now + self.sample_every_s, self._sample)

    # --- request flow -----------------------------------------------------------------------------
    def _arrive(self, i: int) -> None:
        if self.waiting_turn[i]:
            # Its drawn time came before the previous turn's response ended: the agent is still
            # waiting; ``_send_next_turn`` sends it when that response ends.
            self.waiting_turn[i] = False
            self.arr[i] = math.nan
            return
        if self._gateway is not None:
            self._gateway.add(self._request_cpu_s)
        session, cached, n_in, n_out = self.session[i], self.cached[i], self.n_in[i], self.n_out[i]
        idc = self.idc
        if not idc:
            appended = self.appended.get(session)
            if appended is None:
                # Warm start: a session first seen in the trace began before it, so its prefix
                # sits in the cache of one MD (its home by id), as a long-running fleet's would.
                self.seen_sessions.add(session)
                self.appended[session] = appended = 0
                main_list = self._main_list
                home = session_home(self._home_salt, session, len(main_list))
                main_list[home].cache_put(session, 0, cached)
            hits = {}  # what each MD's prefix match gives (``reserve``: may count KV in flight)
            landed_hits = {}  # what its cache holds (the heartbeat's blocks)
            waits: dict[str, int] = {}
            holders = self._holders.get(session)
            if holders:
                in_flight = self._drc_in_flight
                for mid, holder in holders.items():
                    entry = holder.cache.get(session)
                    if entry is not None:
                        version = entry[0]
                        landed_hits[mid] = max(0, cached - (appended - version))
                    else:
                        version = None
                    if in_flight:
                        pending = holder.incoming.get(session)
                        if pending:
                            coming = max(pending)
                            if version is None or coming > version:
                                version = waits[mid] = coming  # counts, but must land first
                    if version is not None:
                        hits[mid] = max(0, cached - (appended - version))
            self.snapshot.prefix_hits = hits if self._decision_in_flight else landed_hits
            # This turn appends its new prompt tokens and its output to the session's context.
            self.appended[session] = self.version[i] = appended + (n_in - cached) + n_out
            pool_wait_aware = self._pool_wait_aware
            for link, state in self._link_pairs:
                # A queue for connections means a new transfer sees a full link, and it first
                # waits for a connection: the pool's expected wait (WanLink.expected_wait_s).
                # Only urgent transfers queue ahead of a new one (background ones yield).
                # With report_interval_s the policy sees the last heartbeat's figure instead,
                # as the live gateway does (WanLinkSpec.report_interval_s).
                if link.report_s:
                    state.utilisation = link.reported_utilisation()
                else:
                    state.utilisation = 1.0 if link.waiting else link.utilisation
                state.pool_wait_s = link.expected_wait_s() if pool_wait_aware else 0.0
        request = self._request  # decide() keeps no reference to it: one object, refilled
        request.prompt_tokens = n_in
        request.max_tokens = n_out
        try:
            decision = routing_policy.decide(request, self._narrowed(), self.settings)
        except NoHealthyPath:
            self._send_next_turn(i)  # counted as never served; the agent carries on
            return
        if self.check_decisions:
            full = routing_policy.decide(request, self.snapshot, self.settings)
            assert full == decision, (i, full, decision)
        pipeline = decision.pipeline
        if pipeline == Pipeline.P_RLD_MD and self._p_rld:
            pipeline = Pipeline.P_RLD  # finish on RLD: the design PDD excludes
        self.pipe[i] = PIPELINE_CODES[pipeline]
        chosen = decision.main_id
        if chosen:
            if not idc and not self._decision_in_flight:
                # P's reservation at the chosen MD counts its KV in flight: the delta P sends.
                self.md_hit[i] = hit = hits.get(chosen, 0)
            else:
                self.md_hit[i] = hit = decision.cached_tokens
            window_hits = self._window_hits
            window_hits[0] += hit
            window_hits[1] += n_in
        if pipeline == Pipeline.P_RLD_MD:
            self.mode[i] = 1 if decision.handoff_mode == HandoffMode.ONE_SHOT else 2
            relay_key = decision.relay_id
            assert relay_key is not None  # a P-RLD-MD decision names its relay
            self.relay[relay_key].state.handoff_mode = decision.handoff_mode
        main_id = chosen if pipeline == Pipeline.P_MD or pipeline == Pipeline.P_RLD_MD else None
        relay_id = decision.relay_id if pipeline != Pipeline.P_MD else None
        prefill_id = decision.prefill_id
        p_cached = cached
        if self._p_affinity:
            # The pipeline and decoders above do not depend on the P.
            prefill_id, p_cached = self._affine_prefill(session, cached)
        self.route[i] = (prefill_id, relay_id, main_id)
        rld: DecodeInstance | None = None
        md: DecodeInstance | None = None
        if relay_id is not None:
            rld = self.relay[relay_id]
            rld.assign()
        if main_id is not None:
            md = self.main[main_id]
            md.assign()
            if not idc:
                if main_id in waits:
                    self.depends[i] = waits[main_id]
                md.expect(session, self.version[i])
        p = self.prefill[prefill_id]
        self._route_obj[i] = (p, rld, md)
        # P's own prefix cache holds the reusable prefix, so P computes only the uncached part.
        p.submit(i, n_in - p_cached, p_cached, self._prefilled)

    def _affine_prefill(self, session: int, cached: int) -> tuple[str, int]:
        """The P the live policy picks when a session's context is on one P, and the tokens of
        the turn that P holds. The live choice is the longest cached prefix (counted only over
        half the prompt) among unsaturated Ps, load breaking ties, a P's load being its
        requests over its slots. So: a session under way when the run starts has its context
        on its home (``session_home``); its turns go to the P that served its last turn while
        that P is not saturated; a new session (only the shared prefix cached, on every P) and
        a turn whose P is saturated go to the P with the fewest requests, first in order on a
        tie, which holds the shared prefix only and becomes the session's P."""
        keys = self._p_keys
        home = self._p_home.get(session)
        if home is None and cached > self._shared:
            home = keys[session_home(self._home_salt, session, len(keys))]
        if home is not None and self.prefill[home].queued < self._p_saturated:
            self._p_home[session] = home
            return home, cached
        prefill = self.prefill
        best = min(keys, key=lambda k: prefill[k].queued)
        self._p_home[session] = best
        return best, min(cached, self._shared)

    def _narrowed(self) -> ClusterSnapshot:
        """The snapshot with only the instances that can win the policy's choice.

        The policy takes, per role, the first healthy candidate in (saturated, -prefix hit,
        load, queue depth, id) order (``pdd.policy._first_in_order``). Every simulated
        instance is healthy and every MD reachable, saturation is a threshold on the load, and
        only MDs in ``prefix_hits`` can have a hit, so the winner is among: the first P by
        (load, id) (a P's queue depth is always 0), the first RLD by (load, queue depth, id),
        the MDs in ``prefix_hits`` and the first MD by (load, queue depth, id). Those come from
        the id-ordered keys the instances keep, at the speed of ``min`` over a list rather than
        the policy's loop over every instance; the decision is the same (``check_decisions``
        asserts it against the full snapshot).
        """
        snap = self._snap
        states, keys = self._prefill_by_id
        snap.prefill = (states[keys.index(min(keys))],)
        states, keys = self._relay_by_id
        if keys:
            snap.relay_decode = (states[keys.index(min(keys))],)
        states, keys = self._main_by_id
        least = states[keys.index(min(keys))]
        hits = self.snapshot.prefix_hits
        if hits:
            main = [self.main[m].state for m in hits]
            if least.id not in hits:
                main.append(least)
            snap.main_decode = tuple(main)
        else:
            snap.main_decode = (least,)
        snap.prefix_hits = hits
        return snap

    def _fabric_s(self, nbytes: float, a, b) -> float:
        gbps = min(a.gpu.interconnect_gbps, b.gpu.interconnect_gbps)
        return self.fleet.fabric.latency_ms / 1000.0 + nbytes * 8 / (gbps * 1e9)

    def _fabric(self, a, b) -> tuple[float, float]:
        """``_fabric_s``'s two constants for a pair of instances: its latency and divisor."""
        key = (a.gpu.interconnect_gbps, b.gpu.interconnect_gbps)
        got = self._fabric_terms.get(key)
        if got is None:
            got = self._fabric_terms[key] = (
                self.fleet.fabric.latency_ms / 1000.0,
                min(key) * 1e9,
            )
        return got

    def _prefilled(self, i: int) -> None:
        p, r, m = self._route_obj[i]
        kv = self._kv_bytes
        now = self.loop.now
        self.prefill_done[i] = now
        if self.idc:
            latency, per_s = self._fabric(p, m)
            delay = latency + self.n_in[i] * kv * 8 / per_s  # = _fabric_s
            self.loop.at(now + delay, self._kv_at_main, i, 0.0, 0.0)
            return
        if r is not None and self.pipe[i] != P_MD:
            latency, per_s = self._relay_fabric or self._fabric(p, r)
            delay = latency + self.n_in[i] * kv * 8 / per_s  # = _fabric_s
            self.loop.at(now + delay, self._kv_at_relay, i)
        if m is not None:
            # MD lacks what its DRC does not hold; P sends that delta (from its own cache too).
            delta = self.n_in[i] - self.md_hit[i]
            link = self.links[m.state.datacenter]
            # A relayed request's user is already served by RLD: its KV to MD can yield the
            # connection queue to transfers a first token waits on.
            background = r is not None and self._yield
            handoff_s = link.spec.handoff_ms / 1000.0
            wire = delta * kv * link.spec.wire_factor  # in the link's transport format
            if handoff_s:  # the ends' fixed work: the KV lands that much after its last byte
                link.send(wire, partial(self._kv_at_main_after, i, handoff_s), background)
            else:
                link.send(wire, partial(self._kv_at_main, i), background)

    def _ctx(self, i: int) -> int:
        return self.n_in[i] + self.n_out[i] // 2

    def _kv_at_relay(self, i: int) -> None:
        rld = self._route_obj[i][1]
        self.relay_kv_at[i] = self.loop.now
        rld.unassign()
        rld.admit(self.ctx[i], partial(self._relay_start, i))

    def _relay_start(self, i: int, tpot: float, job: float) -> None:
        rld = self._route_obj[i][1]
        now = self.loop.now
        if self.md_took_all[i]:
            rld.release(self.ctx[i])  # MD got the KV first and took the whole request
            return
        self.rld_start[i], self.rld_job[i] = now, job
        # First token one step after joining (at the step time of the batch it joins).
        self.ttft[i] = now + tpot - self.arr[i]
        self.first_kv[i], self.first_start[i] = self.relay_kv_at[i], now
        rld.run(job, self.n_out[i], self._relay_end, i)

    def _relay_end(self, i: int) -> None:
        if self.handed[i]:
            return
        self._route_obj[i][1].release(self.ctx[i])
        self.rld_tokens[i] = self.n_out[i]
        self._finished(i)

    def _kv_at_main_after(self, i: int, delay_s: float, transfer_s: float, wait_s: float) -> None:
        self.loop.at(self.loop.now + delay_s, self._kv_at_main, i, transfer_s, wait_s)

    def _kv_at_main(self, i: int, transfer_s: float, wait_s: float) -> None:
        md = self._route_obj[i][2]
        if not self.idc:
            self.wan_s[i], self.wan_wait[i] = transfer_s, wait_s
            session = self.session[i]
            if self.depends:
                needed = self.depends.pop(i, None)
                if needed is not None and md.when_landed(
                    session, needed, partial(self._kv_at_main, i, transfer_s, wait_s)
                ):
                    return  # the earlier turn's KV this delta builds on is still on its way
            md.landed(session, self.version[i])
        self.md_kv_at[i] = self.loop.now
        md.unassign()
        if self.finish[i] == self.finish[i]:  # not NaN
            # RLD already produced every token: MD only ingests the context to stay aligned.
            md.cache_put(self.session[i], self.version[i], self.n_in[i] + self.n_out[i])
            return
        md.admit(self.ctx[i], partial(self._main_start, i))

    def _main_start(self, i: int, tpot: float, job: float) -> None:
        md = self._route_obj[i][2]
        now = self.loop.now
        n_out = self.n_out[i]
        ctx = self.ctx[i]
        md.cache_put(self.session[i], self.version[i], self.n_in[i] + n_out)
        relayed = self.pipe[i] == P_RLD_MD
        if not relayed or self.rld_start[i] != self.rld_start[i]:  # NaN: RLD never started
            if relayed:
                self.md_took_all[i] = True
            self.ttft[i] = now + tpot - self.arr[i]
            self.first_kv[i], self.first_start[i] = self.md_kv_at[i], now
            self.md_tokens[i] = n_out
            md.run(job, n_out, self._main_end, i, ctx)
            return
        if self.finish[i] == self.finish[i]:  # not NaN: RLD has finished
            self.loop.at(now + tpot, md.release, ctx)  # ingest only: one extend step
            return
        rtt = self.fleet.links[md.state.datacenter].rtt_ms / 1000.0
        # One-shot: RLD stops now; MD receives the ids (half an RTT), recomputes their KV in one
        # extend step and continues, a stall the user sees. Catch-up: RLD keeps decoding while
        # MD catches up on a first batch, so RLD stops one round later and nobody stalls.
        one_shot = self.mode[i] == 1
        stop = now if one_shot else now + rtt + tpot
        rld = self._route_obj[i][1]
        # Tokens RLD has made by ``stop``: its clock now plus the rest at its current step time.
        generated = int(rld.produced(self.rld_job[i]) + (stop - now) / rld.step)
        if generated >= n_out:
            self.loop.at(now + tpot, md.release, ctx)  # RLD finishes first; MD ingests only
            return
        self.handed[i] = True
        self.loop.at(stop, rld.release, ctx)
        self.rld_tokens[i] = generated
        self.md_tokens[i] = n_out - generated
        # MD's own steps from now: the wait until it resumes (one-shot: ids cross half an RTT,
        # then one extend step) expressed in its current steps, then the remaining tokens.
        resume = now + rtt / 2 + tpot if one_shot else stop
        md.run(job, (resume - now) / tpot + n_out - generated, self._main_end, i, ctx)

    def _main_end(self, i: int, ctx: int) -> None:
        self._route_obj[i][2].release(ctx)
        self.finish[i] = self.loop.now  # _finished, written out
        self._send_next_turn(i)

    def _finished(self, i: int) -> None:
        """The user has the last token of request ``i``; its session's next turn follows."""
        self.finish[i] = self.loop.now
        self._send_next_turn(i)

    def _send_next_turn(self, i: int) -> None:
        j = self.next_turn[i]
        if j < 0:
            return
        if self.waiting_turn[j]:
            self.waiting_turn[j] = False  # ended before j's drawn time: j arrives as drawn
        else:
            self.arr[j] = self.loop.now  # j's time has passed: the agent sends it now
            self._arrive(j)


class _SlaMissed(Exception):
    """Raised out of the event loop when the run's SLA is certain to fail."""


def _decode_key(inst: DecodeInstance) -> tuple[float, int]:
    return inst.state.load, inst.state.queue_depth


def _rank(instances: list, key) -> tuple[list[InstanceState], list]:
    """The instances' states in id order and their keys, which each instance keeps current
    (``rank_keys[rank_idx]``) from now on."""
    ordered = sorted(instances, key=lambda inst: inst.state.id)
    keys = [key(inst) for inst in ordered]
    for idx, inst in enumerate(ordered):
        assert inst.state.queue_depth == 0 or isinstance(inst, DecodeInstance)
        inst.rank_keys, inst.rank_idx = keys, idx
    return [inst.state for inst in ordered], keys
