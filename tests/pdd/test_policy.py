"""Specification of the PDD routing policy (pdd.policy.decide) and its settings."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace

import pytest

from pdd.policy import (
    ClusterSnapshot,
    Decision,
    HandoffMode,
    InstanceState,
    LinkStatus,
    NoHealthyPath,
    Pipeline,
    PolicySettings,
    RequestInfo,
    Role,
    WanLinkState,
    _choose_main_decode,
    _least_loaded,
    decide,
    estimate_wan_s,
    prefix_hit_tokens,
)

BLOCK = 64
PROMPT_BLOCKS = 1000  # 64,000-token prompt, the agentic norm
HASHES = tuple(f"h{i}" for i in range(PROMPT_BLOCKS))


def request(prompt_blocks: int = PROMPT_BLOCKS, max_tokens: int = 500) -> RequestInfo:
    return RequestInfo(
        prompt_tokens=prompt_blocks * BLOCK,
        max_tokens=max_tokens,
        prefix_block_hashes=HASHES[:prompt_blocks],
        block_tokens=BLOCK,
    )


def main_decode(id_: str, hit: float, load: float = 0.2, dc: str = "B", **kw) -> InstanceState:
    blocks = frozenset(HASHES[: int(PROMPT_BLOCKS * hit)])
    return InstanceState(
        id=id_, role=Role.MAIN_DECODE, datacenter=dc, load=load, cached_prefix_blocks=blocks, **kw
    )


def snapshot(
    *,
    prefill: tuple[InstanceState, ...] | None = None,
    relay: tuple[InstanceState, ...] | None = None,
    main: tuple[InstanceState, ...] | None = None,
    link: WanLinkState | None = None,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        prefill=prefill
        if prefill is not None
        else (InstanceState("p1", Role.PREFILL, "A", load=0.3),),
        relay_decode=relay
        if relay is not None
        else (InstanceState("r1", Role.RELAY_DECODE, "A", load=0.2),),
        main_decode=main if main is not None else (main_decode("m1", hit=0.99),),
        wan_links={"B": link or WanLinkState(bandwidth_gbps=5.0, rtt_ms=30.0)},
    )


SETTINGS = PolicySettings(wan_time_threshold_s=1.0, kv_bytes_per_token=46_000)


# Each row: id, snapshot, request, expected (pipeline, handoff mode, P, RLD, MD, fallback).
CASES = [
    (
        "high hit goes straight to MD",
        snapshot(main=(main_decode("m1", hit=0.99),)),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p1", None, "m1", False),
    ),
    (
        "low hit relays through RLD",
        snapshot(main=(main_decode("m1", hit=0.5),)),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP, "p1", "r1", "m1", False),
    ),
    (
        "busy RLD hands off one-shot",
        snapshot(
            main=(main_decode("m1", hit=0.5),),
            relay=(InstanceState("r1", Role.RELAY_DECODE, "A", load=0.85),),
        ),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.ONE_SHOT, "p1", "r1", "m1", False),
    ),
    (
        "idle RLD hands off catch-up",
        snapshot(
            main=(main_decode("m1", hit=0.5),),
            relay=(InstanceState("r1", Role.RELAY_DECODE, "A", load=0.05),),
        ),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP, "p1", "r1", "m1", False),
    ),
    (
        "RLD in the hysteresis band keeps its one-shot mode",
        snapshot(
            main=(main_decode("m1", hit=0.5),),
            relay=(
                InstanceState(
                    "r1", Role.RELAY_DECODE, "A", load=0.6, handoff_mode=HandoffMode.ONE_SHOT
                ),
            ),
        ),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.ONE_SHOT, "p1", "r1", "m1", False),
    ),
    (
        "no healthy MD falls back to RLD finishing",
        snapshot(main=(main_decode("m1", hit=0.99, healthy=False),)),
        request(),
        (Pipeline.RLD_ONLY, HandoffMode.NONE, "p1", "r1", None, True),
    ),
    (
        "a down WAN link counts as no MD",
        snapshot(link=WanLinkState(bandwidth_gbps=20, rtt_ms=30, status=LinkStatus.DOWN)),
        request(),
        (Pipeline.RLD_ONLY, HandoffMode.NONE, "p1", "r1", None, True),
    ),
    (
        "no healthy RLD sends even low hit to MD",
        snapshot(
            main=(main_decode("m1", hit=0.2),),
            relay=(InstanceState("r1", Role.RELAY_DECODE, "A", healthy=False),),
        ),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p1", None, "m1", True),
    ),
    (
        "singular traffic finishes on RLD",
        snapshot(main=(main_decode("m1", hit=0.1),)),
        request(prompt_blocks=2000, max_tokens=8),
        (Pipeline.RLD_ONLY, HandoffMode.NONE, "p1", "r1", None, False),
    ),
    (
        "long prompt with a long output is not singular",
        snapshot(main=(main_decode("m1", hit=0.1),)),
        request(prompt_blocks=2000, max_tokens=2000),
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP, "p1", "r1", "m1", False),
    ),
    (
        "MD with the longest cached prefix wins",
        snapshot(main=(main_decode("m1", hit=0.5), main_decode("m2", hit=0.99, load=0.7))),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p1", None, "m2", False),
    ),
    (
        "load breaks a tie on cached prefix",
        snapshot(main=(main_decode("m1", hit=0.99, load=0.6), main_decode("m2", hit=0.99))),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p1", None, "m2", False),
    ),
    (
        "a saturated MD loses to one with less cache",
        snapshot(main=(main_decode("m1", hit=0.99, load=1.0), main_decode("m2", hit=0.98))),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p1", None, "m2", False),
    ),
    (
        "least-loaded P is chosen",
        snapshot(
            prefill=(
                InstanceState("p1", Role.PREFILL, "A", load=0.9),
                InstanceState("p2", Role.PREFILL, "A", load=0.1),
                InstanceState("p3", Role.PREFILL, "A", load=0.0, healthy=False),
            )
        ),
        request(),
        (Pipeline.P_MD, HandoffMode.NONE, "p2", None, "m1", False),
    ),
    (
        "least-loaded RLD is chosen",
        snapshot(
            main=(main_decode("m1", hit=0.3),),
            relay=(
                InstanceState("r1", Role.RELAY_DECODE, "A", load=0.7),
                InstanceState("r2", Role.RELAY_DECODE, "A", load=0.1),
            ),
        ),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP, "p1", "r2", "m1", False),
    ),
    (
        "busy WAN pushes a borderline request onto the relay",
        snapshot(
            main=(main_decode("m1", hit=0.9),),
            link=WanLinkState(bandwidth_gbps=5, rtt_ms=30, utilisation=0.9),
        ),
        request(),
        (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP, "p1", "r1", "m1", False),
    ),
]


@pytest.mark.parametrize(
    ("snap", "req", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decide_picks_pipeline_mode_and_instances(snap, req, expected) -> None:
    d = decide(req, snap, SETTINGS)
    assert (d.pipeline, d.handoff_mode, d.prefill_id, d.relay_id, d.main_id, d.fallback) == (
        expected
    )
    assert d.reason


def test_same_borderline_request_goes_direct_on_an_idle_wan() -> None:
    snap = snapshot(main=(main_decode("m1", hit=0.9),))
    assert decide(request(), snap, SETTINGS).pipeline == Pipeline.P_MD


def test_catch_up_decision_carries_the_batch_size() -> None:
    settings = PolicySettings(catch_up_batch_tokens=32, kv_bytes_per_token=46_000)
    d = decide(request(), snapshot(main=(main_decode("m1", hit=0.5),)), settings)
    assert (d.handoff_mode, d.catch_up_batch) == (HandoffMode.CATCH_UP, 32)


def test_delta_and_cached_tokens_follow_the_leading_prefix_run() -> None:
    md = main_decode("m1", hit=0.5)
    # The cache holds the first 10 blocks (a radix cache of chain hashes is prefix-closed:
    # evicting block 10 evicts every block after it, so there are no holes to walk past).
    md.cached_prefix_blocks = frozenset(f"h{k}" for k in range(10))
    d = decide(request(), snapshot(main=(md,)), SETTINGS)
    assert (d.cached_tokens, d.delta_tokens) == (10 * BLOCK, (PROMPT_BLOCKS - 10) * BLOCK)
    assert d.hit_rate == pytest.approx(0.01)


def test_prefix_hits_from_the_snapshot_override_hash_matching() -> None:
    snap = snapshot(main=(main_decode("m1", hit=0.0), main_decode("m2", hit=0.0)))
    snap.prefix_hits = {"m1": 1000, "m2": 63_000}
    d = decide(request(), snap, SETTINGS)
    assert (d.main_id, d.cached_tokens, d.pipeline) == ("m2", 63_000, Pipeline.P_MD)


@pytest.mark.parametrize(
    ("utilisation", "status", "expected_s"),
    [
        (0.0, LinkStatus.UP, 0.030 + 46_000 * 1000 * 8 / 20e9),
        (0.5, LinkStatus.UP, 0.030 + 46_000 * 1000 * 8 / 10e9),
        (0.9, LinkStatus.UP, 0.030 + 46_000 * 1000 * 8 / 2e9),
        (0.0, LinkStatus.DEGRADED, 0.030 + 46_000 * 1000 * 8 / 10e9),
        (1.0, LinkStatus.UP, 0.030 + 46_000 * 1000 * 8 / (20e9 * 0.05)),
    ],
)
def test_wan_estimate_is_rtt_plus_delta_over_available_bandwidth(
    utilisation, status, expected_s
) -> None:
    link = WanLinkState(bandwidth_gbps=20, rtt_ms=30, utilisation=utilisation, status=status)
    assert estimate_wan_s(1000, link, SETTINGS) == pytest.approx(expected_s)


def test_a_window_limited_connection_caps_the_estimate() -> None:
    link = WanLinkState(bandwidth_gbps=20, rtt_ms=30, per_connection_gbps=0.25)
    assert estimate_wan_s(1000, link, SETTINGS) == pytest.approx(0.030 + 46_000 * 1000 * 8 / 0.25e9)


@pytest.mark.parametrize(
    ("pool_wait_s", "expected_s"),
    [
        (0.0, 0.030 + 46_000 * 1000 * 8 / 20e9),
        (-1.0, 0.030 + 46_000 * 1000 * 8 / 20e9),  # a bad negative figure counts as no wait
        (float("nan"), 0.030 + 46_000 * 1000 * 8 / 20e9),
        (2.5, 2.5 + 0.030 + 46_000 * 1000 * 8 / 20e9),
        (float("inf"), float("inf")),
    ],
)
def test_wan_estimate_adds_the_wait_for_a_pool_connection(pool_wait_s, expected_s) -> None:
    link = WanLinkState(bandwidth_gbps=20, rtt_ms=30, pool_wait_s=pool_wait_s)
    assert estimate_wan_s(1000, link, SETTINGS) == pytest.approx(expected_s)


def test_zero_pool_wait_is_the_default_and_changes_nothing() -> None:
    assert WanLinkState(bandwidth_gbps=20, rtt_ms=30).pool_wait_s == 0.0
    for utilisation in (0.0, 0.5, 1.0):
        for per_conn in (None, 0.225):
            plain = WanLinkState(20, 30, utilisation=utilisation, per_connection_gbps=per_conn)
            zero = WanLinkState(
                20, 30, utilisation=utilisation, per_connection_gbps=per_conn, pool_wait_s=0.0
            )
            assert estimate_wan_s(700, zero, SETTINGS) == estimate_wan_s(700, plain, SETTINGS)


# Each row: id, MD hit, pool wait (s), expected pipeline. 64K prompt at 46 KB/token on an idle
# 20 Gbit/s link window-limited to 0.225 Gbit/s per connection, relay threshold 1 s.
POOL_WAIT_CASES = [
    ("high hit, free connection: straight to MD", 0.99, 0.0, Pipeline.P_MD),
    ("high hit, short queue: still under the threshold", 0.99, 0.2, Pipeline.P_MD),
    ("high hit, queued for a connection: relayed", 0.99, 1.5, Pipeline.P_RLD_MD),
    ("low hit, free connection: relayed anyway", 0.5, 0.0, Pipeline.P_RLD_MD),
    ("full hit, long queue: nothing to send, still waits", 1.0, 5.0, Pipeline.P_RLD_MD),
]


@pytest.mark.parametrize(
    ("hit", "pool_wait_s", "pipeline"),
    [row[1:] for row in POOL_WAIT_CASES],
    ids=[row[0] for row in POOL_WAIT_CASES],
)
def test_a_queue_for_wan_connections_pushes_requests_to_the_relay(
    hit, pool_wait_s, pipeline
) -> None:
    settings = PolicySettings(wan_time_threshold_s=1.0, kv_bytes_per_token=4_400)
    link = WanLinkState(20, 30, per_connection_gbps=0.225, pool_wait_s=pool_wait_s)
    d = decide(request(), snapshot(main=(main_decode("m1", hit=hit),), link=link), settings)
    assert d.pipeline == pipeline
    assert d.est_wan_s >= pool_wait_s


def test_a_queue_for_wan_connections_does_not_reject_without_a_relay() -> None:
    link = WanLinkState(20, 30, per_connection_gbps=0.225, pool_wait_s=3.0)
    d = decide(
        request(), snapshot(relay=(), main=(main_decode("m1", hit=0.99),), link=link), SETTINGS
    )
    assert (d.pipeline, d.fallback) == (Pipeline.P_MD, True)


def test_wan_utilisation_raises_the_decision_estimate() -> None:
    idle = decide(request(), snapshot(main=(main_decode("m1", hit=0.95),)), SETTINGS)
    busy_link = WanLinkState(bandwidth_gbps=5, rtt_ms=30, utilisation=0.8)
    busy = decide(
        request(), snapshot(main=(main_decode("m1", hit=0.95),), link=busy_link), SETTINGS
    )
    assert busy.est_wan_s > 4 * (idle.est_wan_s - 0.03)


def test_hit_rate_threshold_alone_can_drive_the_relay() -> None:
    settings = PolicySettings(wan_time_threshold_s=None, min_hit_rate=0.95)
    snap = snapshot(main=(main_decode("m1", hit=0.9),))
    assert decide(request(), snap, settings).pipeline == Pipeline.P_RLD_MD
    snap = snapshot(main=(main_decode("m1", hit=0.96),))
    assert decide(request(), snap, settings).pipeline == Pipeline.P_MD


FULL_MD = PolicySettings(
    wan_time_threshold_s=1.0, kv_bytes_per_token=46_000, relay_when_main_saturated=True
)
RELAY = (InstanceState("r1", Role.RELAY_DECODE, "A", load=0.2),)
BUSY_RELAY = (InstanceState("r1", Role.RELAY_DECODE, "A", load=0.97),)
NO_FULL_MD = PolicySettings(
    wan_time_threshold_s=1.0, kv_bytes_per_token=46_000, relay_when_main_saturated=False
)

# Each row: id, MD pool, RLD pool, settings, expected (pipeline, RLD, MD).
FULL_MD_CASES = [
    (
        "every MD saturated: a high-hit request relays while its prefix MD is full",
        (main_decode("m1", hit=0.99, load=1.0), main_decode("m2", hit=0.0, load=0.96)),
        RELAY,
        FULL_MD,
        (Pipeline.P_RLD_MD, "r1", "m1"),
    ),
    (
        "an unsaturated MD takes it straight, as without the rule",
        (main_decode("m1", hit=0.99, load=1.0), main_decode("m2", hit=0.99, load=0.5)),
        RELAY,
        FULL_MD,
        (Pipeline.P_MD, None, "m2"),
    ),
    (
        "every MD saturated but its prefix MD has a slot left: straight to it",
        (main_decode("m1", hit=0.99, load=0.97), main_decode("m2", hit=0.0, load=0.96)),
        RELAY,
        FULL_MD,
        (Pipeline.P_MD, None, "m1"),
    ),
    (
        "a lower main_full_load relays from there",
        (main_decode("m1", hit=0.99, load=0.97), main_decode("m2", hit=0.0, load=0.96)),
        RELAY,
        replace(FULL_MD, main_full_load=0.95),
        (Pipeline.P_RLD_MD, "r1", "m1"),
    ),
    (
        "a saturated relay does not take the overflow",
        (main_decode("m1", hit=0.99, load=1.0),),
        BUSY_RELAY,
        FULL_MD,
        (Pipeline.P_MD, None, "m1"),
    ),
    (
        "rule off: the request queues on its full MD",
        (main_decode("m1", hit=0.99, load=1.0),),
        RELAY,
        NO_FULL_MD,
        (Pipeline.P_MD, None, "m1"),
    ),
]


@pytest.mark.parametrize(
    ("main", "relay", "settings", "expected"),
    [row[1:] for row in FULL_MD_CASES],
    ids=[row[0] for row in FULL_MD_CASES],
)
def test_a_saturated_main_decode_sends_requests_through_an_idle_relay(
    main, relay, settings, expected
) -> None:
    d = decide(request(), snapshot(main=main, relay=relay), settings)
    assert (d.pipeline, d.relay_id, d.main_id) == expected
    assert d.fallback is False
    if d.pipeline == Pipeline.P_RLD_MD:
        assert "full (load" in d.reason and "until MD has a slot" in d.reason
        assert d.handoff_mode == HandoffMode.CATCH_UP  # the relay's own load picks the mode


def test_the_full_md_rule_is_on_by_default_and_fires_when_every_slot_is_taken() -> None:
    settings = PolicySettings()
    assert settings.relay_when_main_saturated is True
    assert settings.main_full_load == 1.0 and settings.saturated_load == 0.95
    with pytest.raises(ValueError, match="main_full_load"):
        PolicySettings(main_full_load=-0.5)


def test_a_low_hit_request_to_a_full_md_gives_the_wan_as_its_reason() -> None:
    d = decide(request(), snapshot(main=(main_decode("m1", hit=0.5, load=1.0),)), FULL_MD)
    assert d.pipeline == Pipeline.P_RLD_MD
    assert "est WAN" in d.reason and "full (load" not in d.reason


@pytest.mark.parametrize(
    ("snap", "match"),
    [
        (snapshot(prefill=()), "prefill"),
        (
            snapshot(prefill=(InstanceState("p1", Role.PREFILL, healthy=False),)),
            "prefill",
        ),
        (
            snapshot(relay=(), main=(main_decode("m1", hit=0.9, healthy=False),)),
            "relay decode and no reachable main decode",
        ),
    ],
)
def test_no_healthy_path_raises_with_a_reason(snap, match) -> None:
    with pytest.raises(NoHealthyPath, match=match) as info:
        decide(request(), snap, SETTINGS)
    assert info.value.reason


def test_reject_fallbacks_raise_instead_of_degrading() -> None:
    settings = PolicySettings(
        fallback_no_main_decode="reject", fallback_no_relay="reject", kv_bytes_per_token=46_000
    )
    with pytest.raises(NoHealthyPath):
        decide(request(), snapshot(main=()), settings)
    with pytest.raises(NoHealthyPath):
        decide(request(), snapshot(relay=(), main=(main_decode("m1", hit=0.1),)), settings)


@pytest.mark.parametrize("hit", [0.0, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("relay_load", [0.0, 0.6, 0.99])
@pytest.mark.parametrize("max_tokens", [1, 100, 4000])
def test_p_rld_is_never_chosen(hit, relay_load, max_tokens) -> None:
    snap = snapshot(
        main=(main_decode("m1", hit=hit),),
        relay=(InstanceState("r1", Role.RELAY_DECODE, "A", load=relay_load),),
    )
    for blocks in (10, 1000, 2000):
        d = decide(request(blocks, max_tokens), snap, SETTINGS)
        assert d.pipeline != Pipeline.P_RLD
        # Every ordinary (non-singular, non-fallback) pipeline ends on MD.
        if d.pipeline != Pipeline.RLD_ONLY:
            assert d.main_id == "m1"


def test_prefix_hit_tokens_caps_at_the_prompt_length() -> None:
    req = RequestInfo(prompt_tokens=100, max_tokens=1, prefix_block_hashes=HASHES[:2])
    assert prefix_hit_tokens(req, main_decode("m1", hit=1.0)) == 100


def test_snapshot_from_instances_groups_by_role() -> None:
    snap = ClusterSnapshot.from_instances(
        [
            InstanceState("p1", Role.PREFILL),
            InstanceState("r1", Role.RELAY_DECODE),
            InstanceState("m1", Role.MAIN_DECODE, "B"),
        ],
        wan_links={"B": WanLinkState(20, 30)},
    )
    assert [i.id for i in snap.prefill + snap.relay_decode + snap.main_decode] == [
        "p1",
        "r1",
        "m1",
    ]
    with pytest.raises(ValueError, match="role"):
        ClusterSnapshot.from_instances([InstanceState("x", "gpu")], wan_links={})


# --- settings -------------------------------------------------------------------------------


def test_settings_round_trip_through_json() -> None:
    settings = PolicySettings(wan_time_threshold_s=2.5, min_hit_rate=0.9, catch_up_batch_tokens=32)
    restored = PolicySettings.from_dict(json.loads(json.dumps(settings.to_dict())))
    assert restored == settings


def test_settings_from_dict_fills_defaults() -> None:
    assert PolicySettings.from_dict({}) == PolicySettings()
    # P's token rides with the decoding role's stream unless an operator asks otherwise.
    assert PolicySettings().stream_first_token_early is False


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"wan_time_threshold_s": -1}, "wan_time_threshold_s"),
        ({"wan_time_threshold_s": "fast"}, "wan_time_threshold_s"),
        ({"wan_time_threshold_s": None, "min_hit_rate": None}, "wan_time_threshold_s"),
        ({"min_hit_rate": 1.5}, "min_hit_rate"),
        ({"catch_up_batch_tokens": 0}, "catch_up_batch_tokens"),
        ({"catch_up_batch_tokens": 6.5}, "catch_up_batch_tokens"),
        ({"catch_up_batch_tokens": True}, "catch_up_batch_tokens"),
        ({"rld_load_catch_up_below": 0.9, "rld_load_one_shot_above": 0.5}, "rld_load_catch_up"),
        ({"singular_enabled": "yes"}, "singular_enabled"),
        ({"relay_when_main_saturated": 1}, "relay_when_main_saturated"),
        ({"stream_first_token_early": "no"}, "stream_first_token_early"),
        ({"singular_max_hit_rate": -0.1}, "singular_max_hit_rate"),
        ({"fallback_no_main_decode": "p-md"}, "fallback_no_main_decode"),
        ({"fallback_no_relay": "rld-only"}, "fallback_no_relay"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"wan_min_share": 0}, "wan_min_share"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_settings_validation_names_the_bad_field(data, field) -> None:
    with pytest.raises(ValueError, match=field):
        PolicySettings.from_dict(data)


def test_settings_from_dict_rejects_non_mappings() -> None:
    with pytest.raises(ValueError, match="settings"):
        PolicySettings.from_dict([("catch_up_batch_tokens", 3)])  # type: ignore[arg-type]


def test_decision_serialises_for_the_decision_log() -> None:
    d = decide(request(), snapshot(), SETTINGS)
    assert isinstance(d, Decision)
    assert json.loads(json.dumps(d.to_dict()))["pipeline"] == Pipeline.P_MD


def test_decide_is_fast_enough_for_the_gateway() -> None:
    # Realistic shape: 4 P, 2 RLD, 8 MD, hits given by a cache index. Generous bound so the test
    # is not flaky on a shared 2-core machine; the benchmark times 100k decisions properly.
    snap = ClusterSnapshot(
        prefill=tuple(InstanceState(f"p{i}", Role.PREFILL, "A", load=i / 10) for i in range(4)),
        relay_decode=tuple(InstanceState(f"r{i}", Role.RELAY_DECODE, "A") for i in range(2)),
        main_decode=tuple(InstanceState(f"m{i}", Role.MAIN_DECODE, "B") for i in range(8)),
        wan_links={"B": WanLinkState(20, 30)},
        prefix_hits={f"m{i}": 8000 * i for i in range(8)},
    )
    req = request()
    start = time.perf_counter()
    for _ in range(10_000):
        decide(req, snap, SETTINGS)
    assert time.perf_counter() - start < 2.0


def test_instance_choice_follows_the_documented_order_on_random_pools() -> None:
    # _least_loaded and _choose_main_decode compare field by field for speed; their choice must
    # be the minimum of the documented key tuples, ties and saturation included.
    rng = random.Random(7)
    settings = PolicySettings()
    loads = [0.0, 0.3, 0.3, 0.94, 0.95, 1.0, 1.2]
    for _ in range(2000):
        pool = tuple(
            InstanceState(
                f"i{rng.randrange(20)}",
                Role.MAIN_DECODE,
                "B",
                healthy=rng.random() > 0.1,
                load=rng.choice(loads),
                queue_depth=rng.randrange(3),
            )
            for _ in range(rng.randrange(6))
        )
        healthy = [i for i in pool if i.healthy]
        expected = min(
            healthy,
            key=lambda i: (i.load >= settings.saturated_load, i.load, i.queue_depth, i.id),
            default=None,
        )
        assert _least_loaded(pool, settings.saturated_load) is expected
        hits = {i.id: rng.choice([0, 100, 100, 5000]) for i in pool}
        snap = ClusterSnapshot(
            main_decode=pool, wan_links={"B": WanLinkState(20, 20)}, prefix_hits=hits
        )
        best = min(
            healthy,
            key=lambda i: (
                i.load >= settings.saturated_load,
                -hits[i.id],
                i.load,
                i.queue_depth,
                i.id,
            ),
            default=None,
        )
        chosen, cached, _ = _choose_main_decode(request(), snap, settings)
        assert chosen is best
        assert cached == (hits[best.id] if best is not None else 0)
