"""The longest cached prefix by binary search over chain hashes equals the block-by-block walk
on every prefix-closed cache (what a radix cache of chain hashes is)."""

from __future__ import annotations

import random

from pdd.policy import InstanceState, RequestInfo, leading_run, prefix_hit_tokens


def _walk(hashes, held) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


def test_binary_search_equals_the_walk_on_prefix_closed_caches():
    rng = random.Random(7)
    for _ in range(2000):
        sessions = [[f"s{s}-b{b}" for b in range(rng.randint(0, 40))] for s in range(3)]
        held = set()
        for blocks in sessions:  # each session cached up to some depth: prefix-closed
            held.update(blocks[: rng.randint(0, len(blocks))])
        request = rng.choice(sessions)
        if request and rng.random() < 0.3:  # a request that diverges from its session
            cut = rng.randint(0, len(request))
            request = request[:cut] + [f"new-{k}" for k in range(rng.randint(1, 5))]
        assert leading_run(request, held) == _walk(request, held)


def test_edges():
    assert leading_run([], {"a"}) == 0
    assert leading_run(["a", "b"], set()) == 0
    assert leading_run(["a", "b"], {"a", "b"}) == 2
    assert leading_run(["a", "b", "c"], {"a"}) == 1
    assert leading_run(["x"], {"a"}) == 0


def test_hit_tokens_count_whole_blocks_within_the_prompt():
    md = InstanceState("md", "main_decode", cached_prefix_blocks=frozenset({"h0", "h1"}))
    request = RequestInfo(prompt_tokens=150, max_tokens=8, prefix_block_hashes=("h0", "h1", "h2"))
    assert prefix_hit_tokens(request, md) == 128
    short = RequestInfo(prompt_tokens=100, max_tokens=8, prefix_block_hashes=("h0", "h1"))
    assert prefix_hit_tokens(short, md) == 100


def test_prefill_goes_to_the_p_holding_the_prompts_prefix_unless_it_is_saturated():
    from pdd.policy import ClusterSnapshot, PolicySettings, WanLinkState, decide

    hashes = tuple(f"{i:016x}" for i in range(1, 9))
    request = RequestInfo(
        prompt_tokens=128, max_tokens=8, prefix_block_hashes=hashes, block_tokens=16
    )

    def snapshot(p2_load: float) -> ClusterSnapshot:
        return ClusterSnapshot(
            prefill=(
                InstanceState("p1", "prefill", "A", load=0.1),
                InstanceState(
                    "p2", "prefill", "A", load=p2_load, cached_prefix_blocks=frozenset(hashes)
                ),
            ),
            relay_decode=(InstanceState("r1", "relay_decode", "A"),),
            main_decode=(InstanceState("m1", "main_decode", "A"),),
            wan_links={"A": WanLinkState(bandwidth_gbps=100.0, rtt_ms=0.1)},
        )

    settings = PolicySettings()
    assert decide(request, snapshot(0.5), settings).prefill_id == "p2"  # busier, but holds it
    assert decide(request, snapshot(1.0), settings).prefill_id == "p1"  # saturated: balance


def test_a_short_shared_prefix_does_not_keep_a_new_prefill_idle():
    """Fresh prompts that share only a system prompt: the P holding it is no better than a P
    started later, so the least loaded one takes them (a hit below prefill_min_hit_share of the
    prompt does not count); a session's turn, mostly cached, still goes back to its P."""
    from pdd.policy import ClusterSnapshot, PolicySettings, WanLinkState, decide

    system = tuple(f"{i:016x}" for i in range(1, 3))  # 2 blocks: 32 of 128 tokens
    fresh = RequestInfo(prompt_tokens=128, max_tokens=8, block_tokens=16,
                        prefix_block_hashes=system + tuple(f"f{i}" for i in range(6)))  # fmt: skip
    turn = RequestInfo(prompt_tokens=128, max_tokens=8, block_tokens=16,
                       prefix_block_hashes=system + tuple(f"s{i}" for i in range(6)))  # fmt: skip
    held = frozenset(system + tuple(f"s{i}" for i in range(5)))  # the session: 112 of 128
    snap = ClusterSnapshot(
        prefill=(
            InstanceState("p-old", "prefill", "A", load=0.6, cached_prefix_blocks=held),
            InstanceState("p-new", "prefill", "A", load=0.0),
        ),
        relay_decode=(InstanceState("r1", "relay_decode", "A"),),
        main_decode=(InstanceState("m1", "main_decode", "A"),),
        wan_links={"A": WanLinkState(bandwidth_gbps=100.0, rtt_ms=0.1)},
    )
    settings = PolicySettings()
    assert decide(fresh, snap, settings).prefill_id == "p-new"  # 25% cached: least loaded
    assert decide(turn, snap, settings).prefill_id == "p-old"  # 87% cached: its home P
    every_hit = PolicySettings(prefill_min_hit_share=0.0)
    assert decide(fresh, snap, every_hit).prefill_id == "p-old"  # the former rule


def test_an_instance_of_another_block_size_is_matched_with_hashes_of_its_size():
    big = ("b0", "b1")  # the prompt in blocks of 32
    md = InstanceState("md", "main_decode", cached_prefix_blocks=frozenset(big), block_tokens=32)
    request = RequestInfo(
        prompt_tokens=80,
        max_tokens=8,
        prefix_block_hashes=("s0", "s1", "s2", "s3", "s4"),
        block_tokens=16,
        hashes_by_block={32: big},
    )
    assert request.hashes_for(md) == (big, 32)
    assert prefix_hit_tokens(request, md) == 64
    # Without its size's hashes the request's own are used: nothing of them is held there.
    assert prefix_hit_tokens(RequestInfo(80, 8, ("s0", "s1"), 16), md) == 0
    # An instance that states no size (0) or the request's is matched as before.
    same = InstanceState("m2", "main_decode", cached_prefix_blocks=frozenset({"s0"}))
    assert prefix_hit_tokens(request, same) == 16
