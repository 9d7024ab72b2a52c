"""Closed-loop agent sessions: a turn is never sent before its previous turn's response ended."""

from __future__ import annotations

import numpy as np
import pytest

from pdd.spec import build
from planner.api import make_trace, run_case, run_fleet
from planner.fleet import fleet_from_dict, session_home
from planner.metrics import Sla
from planner.scenario import deep_merge, load_scenario
from planner.sim import Simulator
from planner.workload import Trace, WorkloadSpec, generate, read_trace, write_trace

POOLS = [
    {"role": "prefill", "gpu": "GPU-A", "count": 2, "datacenter": "A"},
    {"role": "relay_decode", "gpu": "GPU-A", "count": 1, "datacenter": "A"},
    {"role": "main_decode", "gpu": "GPU-B", "count": 2, "datacenter": "B"},
]


def config(closed_loop: bool) -> dict:
    base = load_scenario({"name": "t", "include": "_common.json"})["base"]
    # Turns 2 s apart on average: far shorter than a response, so most turns are drawn
    # before the previous one has ended.
    workload = {"rps": 4, "duration_s": 120, "seed": 5, "mean_turns": 6, "turn_gap_s": 2.0,
                "settle_s": 0}  # fmt: skip
    return deep_merge(
        base,
        {
            "fleet": {"system": "pdd", "pools": POOLS},
            "workload": workload | {"closed_loop": closed_loop},
            "warmup_s": 10,
        },
    )


def simulate(closed_loop: bool, in_flight: bool = True, decision_in_flight: bool = True):
    # The transfer-side tests keep the policy counting KV in flight too (not the default), so
    # the MD a turn is routed to is the one its context is on its way to: deciding on landed KV
    # only, the policy may route a turn to another MD that holds less of it.
    cfg = config(closed_loop)
    cfg["fleet"]["drc_counts_in_flight"] = in_flight
    cfg["fleet"]["decision_counts_in_flight"] = decision_in_flight
    trace = make_trace(cfg)
    record = Simulator(fleet_from_dict(cfg["fleet"])).run(trace)
    return trace, record


def early_turns(trace: Trace, record) -> int:
    """Turns sent before their session's previous turn had its last token."""
    prev = trace.previous_turn()
    has_prev = prev >= 0
    sent = record.arrival_s[has_prev]
    before_end = record.finish_s[prev[has_prev]]
    return int(np.sum(sent < before_end - 1e-9))


def test_generated_traces_are_closed_loop_by_default() -> None:
    spec_trace = make_trace(config(True))
    assert spec_trace.closed_loop
    assert not make_trace(config(False)).closed_loop


def test_closed_loop_sends_no_turn_before_the_previous_response_ended() -> None:
    trace, record = simulate(True)
    assert early_turns(trace, record) == 0
    sent = ~np.isnan(record.arrival_s)
    # A turn is sent at its drawn time or later, never earlier.
    assert np.all(record.arrival_s[sent] >= trace.arrival_s[sent] - 1e-9)
    assert np.any(record.arrival_s[sent] > trace.arrival_s[sent] + 1e-6)
    # Every turn whose predecessor ended was sent and served.
    assert sent.sum() == len(trace) - np.isnan(record.finish_s).sum()


def test_open_loop_sends_turns_over_unfinished_responses() -> None:
    trace, record = simulate(False)
    assert early_turns(trace, record) > 0
    assert np.array_equal(record.arrival_s, trace.arrival_s)


def hit(record) -> float:
    return record.md_hit_tokens.sum() / record.input_tokens.sum()


def test_closed_loop_keeps_md_cache_in_step_with_the_session() -> None:
    # Only landed KV counting: an open-loop turn that arrives before the previous turn's KV
    # reached MD misses that context and resends it.
    _, open_rec = simulate(False, in_flight=False)
    _, closed_rec = simulate(True, in_flight=False)
    assert hit(closed_rec) > hit(open_rec)


def lacking(trace: Trace, record) -> int:
    """Served turns whose MD held less of the session than the turn could reuse."""
    served = record.pipeline >= 0
    return int(((record.md_hit_tokens < trace.cached_tokens) & served).sum())


def test_kv_in_flight_counts_so_a_turn_does_not_resend_its_context() -> None:
    # Closed loop, but the relay answers before MD has the KV: the next turn can be sent
    # while it is still on the WAN. Counting it, MD's match covers the whole reusable prefix.
    trace, with_flight = simulate(True, in_flight=True)
    _, landed_only = simulate(True, in_flight=False)
    assert lacking(trace, landed_only) > 0
    assert lacking(trace, with_flight) == 0
    assert hit(with_flight) > hit(landed_only)


def test_a_delta_built_on_kv_in_flight_waits_for_it_to_land() -> None:
    trace, record = simulate(True, in_flight=True)
    prev = trace.previous_turn()
    pairs = (prev >= 0) & ~np.isnan(record.md_kv_at_s)
    pairs[pairs] &= ~np.isnan(record.md_kv_at_s[prev[pairs]])
    later, earlier = record.md_kv_at_s[pairs], record.md_kv_at_s[prev[pairs]]
    # MD never uses a turn's delta before the context it extends has landed ...
    assert np.all(later >= earlier - 1e-9)
    # ... and some turns were sent while that context was still on the WAN (they waited).
    sent = record.arrival_s[pairs]
    assert np.any(sent < earlier)


def waited_p_md(trace: Trace, record) -> int:
    """P-MD turns sent while the previous turn's KV was still on its way to MD."""
    prev = trace.previous_turn()
    pairs = (prev >= 0) & (record.pipeline == 0)
    pairs[pairs] &= ~np.isnan(record.md_kv_at_s[prev[pairs]])
    return int(np.sum(record.arrival_s[pairs] < record.md_kv_at_s[prev[pairs]]))


def test_the_decision_sees_landed_kv_as_the_live_gateway_does() -> None:
    # Default: the policy decides on MD's cache (the heartbeat's blocks), while P's reserve
    # still counts the KV in flight, so fewer turns whose context is still crossing the WAN
    # go P-MD to wait for it (more are relayed), and the delta still counts that KV (more of
    # each turn's context is reused than when only landed KV counts).
    trace, live = simulate(True, decision_in_flight=False)
    _, sees_flight = simulate(True, decision_in_flight=True)
    _, landed_only = simulate(True, in_flight=False, decision_in_flight=False)
    assert waited_p_md(trace, sees_flight) > 0
    assert waited_p_md(trace, live) < waited_p_md(trace, sees_flight)
    assert (live.pipeline == 1).sum() > (sees_flight.pipeline == 1).sum()
    assert hit(live) > hit(landed_only)
    assert fleet_from_dict(config(True)["fleet"]).decision_counts_in_flight is False


@pytest.mark.parametrize("key", ["drc_counts_in_flight", "decision_counts_in_flight"])
def test_in_flight_switches_must_be_bools(key) -> None:
    cfg = config(True)
    cfg["fleet"][key] = "yes"
    with pytest.raises(ValueError, match=key):
        fleet_from_dict(cfg["fleet"])


def test_window_follows_the_drawn_arrivals_and_offered_rate_what_arrived() -> None:
    cfg = config(True)
    trace = make_trace(cfg)
    summary, record = run_fleet(fleet_from_dict(cfg["fleet"]), trace, Sla(), 10.0)
    drawn = trace.arrival_s >= 10.0
    span = trace.arrival_s[-1] - 10.0
    assert summary["requests"] == int(drawn.sum())
    assert summary["drawn_rps"] == pytest.approx(drawn.sum() / span)
    arrived = (record.arrival_s >= 10.0) & (record.arrival_s <= trace.arrival_s[-1])
    assert summary["offered_rps"] == pytest.approx(arrived.sum() / span)
    assert summary["offered_rps"] <= summary["drawn_rps"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_replayed_trace_is_open_unless_asked(tmp_path, suffix) -> None:
    trace = generate(_spec())
    path = tmp_path / f"t{suffix}"
    write_trace(trace, path)
    assert not read_trace(path).closed_loop
    assert read_trace(path, closed_loop=True).closed_loop
    cfg = deep_merge(config(True), {"trace_file": str(path), "trace_closed_loop": True})
    assert make_trace(cfg).closed_loop


def test_trace_closed_loop_must_be_boolean(tmp_path) -> None:
    path = tmp_path / "t.csv"
    write_trace(generate(_spec()), path)
    with pytest.raises(ValueError, match="trace_closed_loop"):
        make_trace({"trace_file": str(path), "trace_closed_loop": "yes"})


def _spec() -> WorkloadSpec:
    return build(WorkloadSpec, config(True)["workload"], "workload")


def test_a_run_setting_at_the_scenario_top_level_is_refused_naming_it() -> None:
    from planner.scenario import load_scenario

    with pytest.raises(ValueError, match="unknown top-level key.*'trace_file'.*under base"):
        load_scenario({"name": "t", "include": "_common.json", "trace_file": "x.csv"})
    # Comments ("_"-prefixed) and the known keys are fine.
    load_scenario({"name": "t", "include": "_common.json", "_note": "ok", "description": "d"})


def test_a_settle_span_is_simulated_but_not_measured() -> None:
    cfg = deep_merge(config(True), {"workload": {"settle_s": 60}})
    trace = make_trace(cfg)
    assert trace.settle_s == 60.0
    assert trace.arrival_s[0] >= 0.0 and trace.arrival_s[-1] < 60.0 + 120.0
    # Turns drawn in the settle span are sent (they build the sessions' state) ...
    assert np.sum(trace.arrival_s < 60.0) > 100
    summary, record = run_fleet(fleet_from_dict(cfg["fleet"]), trace, Sla(), 10.0)
    # ... but figures count from the span's end plus the warm-up.
    assert summary["requests"] == int(np.sum(trace.arrival_s >= 70.0))
    assert np.all(np.isfinite(record.ttft_s[trace.arrival_s < 60.0]))


def test_settling_lets_a_slow_fleet_receive_the_drawn_rate() -> None:
    # Turns 4 s apart on average, responses ~17-25 s: each session waits on its answers, so a
    # fleet holds more sessions open than the drawn gap implies. Started cold, the run has
    # too few of them and receives far less than drawn; after a settle span of ~4 session
    # lifetimes it receives nearly the drawn rate, and its responses slow under the real load.
    from tests.planner.test_sim import small_config

    def run(settle: float) -> dict:
        workload = {"turn_gap_s": 4.0, "mean_turns": 8, "rps": 4, "duration_s": 300, "seed": 5}
        return run_case("c", small_config("pdd", settle_s=settle, **workload), "fleet").summary

    cold, settled = run(0.0), run(600.0)
    assert cold["offered_rps"] < 0.8 * cold["drawn_rps"]
    assert settled["offered_rps"] > 0.85 * settled["drawn_rps"]
    assert settled["e2e_s"]["mean"] > cold["e2e_s"]["mean"]


@pytest.mark.parametrize("bad", [-1, "long", float("inf"), True])
def test_settle_must_be_a_non_negative_number(bad) -> None:
    with pytest.raises(ValueError, match="settle_s"):
        make_trace(deep_merge(config(True), {"workload": {"settle_s": bad}}))


def test_a_transfer_only_run_has_no_settle_span() -> None:
    cfg = {"workload": {**config(True)["workload"], "settle_s": 500}}
    assert make_trace(cfg, settle=False).settle_s == 0.0
    plain = make_trace({"workload": {**cfg["workload"], "settle_s": 0}})
    assert np.array_equal(make_trace(cfg, settle=False).arrival_s, plain.arrival_s)


def test_with_prefill_affinity_every_turn_of_a_session_goes_to_its_home_prefill() -> None:
    """fleet.prefill_affinity models the live fleet, where a session's context is on one P and
    the policy's longest-prefix choice sends its turns back there; without it the least
    backlogged P is chosen (and holds every prefix)."""
    used: dict[bool, dict[int, set[str]]] = {}
    for affinity in (False, True):
        cfg = config(True)
        cfg["fleet"]["prefill_affinity"] = affinity
        trace = make_trace(cfg)
        sim = Simulator(fleet_from_dict(cfg["fleet"]))
        record = sim.run(trace)
        served = ~np.isnan(record.arrival_s)
        by_session: dict[int, set[str]] = {}
        for i in np.flatnonzero(served):
            if sim.route[i] is not None:
                by_session.setdefault(int(trace.session_id[i]), set()).add(sim.route[i][0])
        used[affinity] = by_session
    keys = sorted({p for ps in used[True].values() for p in ps})
    assert len(keys) == 2
    assert all(len(ps) == 1 for ps in used[True].values())
    assert any(len(ps) > 1 for ps in used[False].values())


def test_prefill_affinity_must_be_a_boolean() -> None:
    cfg = config(True)
    cfg["fleet"]["prefill_affinity"] = "yes"
    with pytest.raises(ValueError, match="prefill_affinity"):
        fleet_from_dict(cfg["fleet"])


def test_a_session_under_way_starts_on_its_salted_home_and_a_new_one_on_the_idlest_p() -> None:
    """With a salt, a session already under way when the run starts has its context on the P
    (and MD) ``session_home`` names, the rule a live benchmark warms its caches by; a session
    that opens in the run (only the shared prefix cached) goes to the P with fewest requests
    and stays there."""
    cfg = config(True)
    cfg["fleet"]["prefill_affinity"] = True
    cfg["fleet"]["session_home_salt"] = "pdd"
    trace = make_trace(cfg)
    assert trace.shared_prefix_tokens == cfg["workload"]["context"]["shared_prefix_tokens"]
    sim = Simulator(fleet_from_dict(cfg["fleet"]))
    sim.run(trace)
    keys = list(sim.prefill)
    first: dict[int, int] = {}
    for i in range(len(trace)):
        first.setdefault(int(trace.session_id[i]), i)
    under_way = opened = 0
    for s, i in first.items():
        if sim.route[i][0] == "":
            continue  # never served
        if trace.cached_tokens[i] > trace.shared_prefix_tokens:
            assert sim.route[i][0] == keys[session_home("pdd", s, len(keys))]
            under_way += 1
        else:
            opened += 1
    assert under_way > 5 and opened > 0
    # The salt moves the homes: some session starts elsewhere than on session % n.
    moved = [s for s, i in first.items() if trace.cached_tokens[i] > trace.shared_prefix_tokens
             and session_home("pdd", s, len(keys)) != s % len(keys)]  # fmt: skip
    assert moved


def test_session_home_is_stable_and_checked() -> None:
    assert session_home(None, 7, 5) == 2
    assert session_home("pdd", 7, 5) == session_home("pdd", 7, 5)
    assert {session_home("pdd", s, 5) for s in range(100)} == set(range(5))
    cfg = config(True)
    cfg["fleet"]["session_home_salt"] = 3
    with pytest.raises(ValueError, match="session_home_salt"):
        fleet_from_dict(cfg["fleet"])
