"""P's done-event statistics parsed into typed records: well-formed values kept, the rest at
their defaults (a reader never digs into raw dicts)."""

from __future__ import annotations

import math

from pdd.stats import DoneStats, HandoffStats


def test_a_full_report_round_trips():
    raw = {
        "pipeline": "p-rld-md",
        "ttft_s": 0.25,
        "prefill_s": 0.1,
        "kv_wait_s": 0.15,
        "max_gap_s": 0.03,
        "e2e_s": 1.5,
        "first_token_early": False,
        "prefill_cached_tokens": 64,
        "cached_tokens": 128,
        "tokens_by_role": {"prefill": 1, "rld": 10, "md": 21},
        "kv_bytes": {"intra_dc": 4096, "wan": 2048},
        "kv_wire_bytes": {"intra_dc": 4100, "wan": 2100},
        "handoff_bytes": 40,
        "handoff": {"mode": "one-shot", "at_token": 11, "batches": 1, "completed": True},
        "main_error": None,
    }
    stats = DoneStats.from_json(raw)
    assert stats.tokens_by_role == {"prefill": 1, "rld": 10, "md": 21}
    assert stats.handoff == HandoffStats(mode="one-shot", at_token=11, batches=1, completed=True)
    assert stats.kv_bytes == {"intra_dc": 4096, "wan": 2048}
    assert DoneStats.from_json(stats.to_json()) == stats


def test_malformed_values_fall_back_to_defaults():
    stats = DoneStats.from_json(
        {
            "ttft_s": math.nan,
            "prefill_s": "fast",
            "kv_wait_s": True,
            "cached_tokens": -3,
            "tokens_by_role": {"rld": "many", "md": 4},
            "kv_bytes": [1, 2],
            "handoff": {"at_token": True, "batches": -1, "completed": "yes"},
        }
    )
    assert (stats.ttft_s, stats.prefill_s, stats.kv_wait_s) == (None, None, None)
    assert stats.cached_tokens == 0
    assert stats.tokens_by_role == {"prefill": 0, "rld": 0, "md": 4}
    assert stats.kv_bytes == {"intra_dc": 0, "wan": 0}
    assert stats.handoff == HandoffStats()
    assert DoneStats.from_json(None) == DoneStats()
    assert DoneStats.from_json({}).tokens_by_role is None  # not reported: the gateway counts


def test_tokens_are_made_and_recognised_one_way_for_keys_and_agents():
    from pdd import tokens

    raw, prefix, stored = tokens.new_token("sk-baton", "-", 4)
    assert raw.startswith(f"sk-baton-{prefix}-") and len(prefix) == 8
    assert tokens.token_prefix(raw, "sk-baton", "-") == prefix
    assert tokens.matches(raw, stored) and not tokens.matches(raw + "x", stored)
    agent, agent_prefix, _ = tokens.new_token("bnt", "_", 6)
    assert tokens.token_prefix(agent, "bnt", "_") == agent_prefix
    for bad in ("", "sk-baton-", "sk-baton-abc", "bnt_x", "other-abc-def"):
        assert tokens.token_prefix(bad, "sk-baton", "-") is None
