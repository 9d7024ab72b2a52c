"""Specification of the agentic workload generator and the trace-file reader."""

from __future__ import annotations

import numpy as np
import pytest

from planner.workload import (
    ContextGrowth,
    HitRateDist,
    WorkloadSpec,
    generate,
    read_trace,
    write_trace,
)


def spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"rps": 50.0, "duration_s": 120.0, "seed": 7, **kw})


def test_same_seed_gives_the_same_trace() -> None:
    a, b = generate(spec()), generate(spec())
    for name in ("arrival_s", "input_tokens", "cached_tokens", "output_tokens", "session_id"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def test_another_seed_gives_another_trace() -> None:
    assert not np.array_equal(generate(spec()).input_tokens, generate(spec(seed=8)).input_tokens)


def test_arrival_rate_and_order_match_the_spec() -> None:
    trace = generate(spec())
    trace.validate()
    assert len(trace) / 120.0 == pytest.approx(50.0, rel=0.1)
    assert np.all(np.diff(trace.arrival_s) >= 0)


def test_skewed_hit_rates_are_production_shaped() -> None:
    hit = generate(spec(rps=200.0)).hit_rate
    assert hit.mean() == pytest.approx(0.9, abs=0.01)
    assert 0.7 <= (hit > 0.95).mean() <= 0.8
    assert (hit < 0.5).mean() > 0.02  # a few low-hit requests carry most of the KV


def test_uniform_hit_rates_stay_in_their_band() -> None:
    hit = generate(spec(hit_rate=HitRateDist(kind="uniform", lo=0.85, hi=0.95))).hit_rate
    assert hit.min() >= 0.849 and hit.max() <= 0.95
    assert hit.mean() == pytest.approx(0.9, abs=0.01)


def test_outputs_are_short_for_a_third_of_agentic_requests() -> None:
    out = generate(spec(rps=200.0)).output_tokens
    assert 0.25 <= (out < 100).mean() <= 0.4
    assert 0.35 <= (out <= 500).mean() <= 0.5


def test_sessions_have_several_turns_in_order() -> None:
    trace = generate(spec(rps=100.0, duration_s=600.0))
    _, turns = np.unique(trace.session_id, return_counts=True)
    assert turns.max() > 3
    assert len(turns) < len(trace) / 2


def test_impossible_skew_is_rejected() -> None:
    with pytest.raises(ValueError, match="mean"):
        HitRateDist(kind="skewed", mean=0.99, high_fraction=0.75, high_lo=0.95)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_round_trips_through_a_file(tmp_path, suffix) -> None:
    trace = generate(spec(duration_s=10.0))
    path = tmp_path / f"trace{suffix}"
    write_trace(trace, path)
    back = read_trace(path)
    assert np.allclose(back.arrival_s, trace.arrival_s)
    for name in ("input_tokens", "cached_tokens", "output_tokens"):
        assert np.array_equal(getattr(back, name), getattr(trace, name))
    # Session ids are renumbered in order of appearance but keep the grouping.
    assert len(np.unique(back.session_id)) == len(np.unique(trace.session_id))


def test_trace_accepts_hit_rate_and_prefix_id(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "arrival_s,input_tokens,hit_rate,output_tokens,prefix_id\n"
        "1.5,1000,0.5,10,agent-x\n0.5,2000,0.9,20,agent-x\n"
    )
    trace = read_trace(path)
    assert trace.arrival_s.tolist() == [0.5, 1.5]
    assert trace.cached_tokens.tolist() == [1800, 500]
    assert trace.session_id.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.csv", "arrival_s,input_tokens,output_tokens\n1,100,10\n", "a.csv:2: needs cached"),
        ("b.csv", "arrival_s,input_tokens,cached_tokens,output_tokens\n1,x,0,10\n", "b.csv:2"),
        ("c.csv", "arrival_s,input_tokens,cached_tokens,output_tokens\n1,10,20,10\n", "range"),
        ("d.csv", "time,tokens\n1,2\n", "header"),
        ("e.jsonl", '{"arrival_s": 1}\n', "e.jsonl:1: missing input_tokens"),
        ("f.jsonl", '{"arrival_s": 1, "input_tokens": 5\n', "f.jsonl:1: not JSON"),
        ("g.jsonl", "[1, 2]\n", "JSON object"),
        ("h.jsonl", "\n", "no requests"),
    ],
)
def test_bad_trace_files_name_the_line(tmp_path, name, text, match) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(path)


def test_missing_trace_file_is_a_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such trace"):
        read_trace(tmp_path / "nope.csv")


def session_spec(**kw) -> WorkloadSpec:
    session = {"context": ContextGrowth(), "hit_rate": HitRateDist(kind="session")}
    return spec(**{"rps": 80.0, "duration_s": 200.0, "mean_turns": 16, **session, **kw})


def test_session_growth_gives_the_published_hit_skew() -> None:
    trace = generate(session_spec())
    hit = trace.hit_rate
    assert hit.mean() == pytest.approx(0.9, abs=0.02)
    assert 0.7 <= (hit > 0.95).mean() <= 0.8
    assert 50_000 <= trace.input_tokens.mean() <= 70_000
    # Low-hit requests are openings/compactions: their whole context is new KV.
    low = hit < 0.5
    delta = trace.input_tokens - trace.cached_tokens
    assert delta[low].mean() > 10 * delta[~low].mean()


def test_growth_carries_fewer_bytes_than_uniform_at_equal_mean_hit() -> None:
    # Same lengths, same mean hit: the session skew's token-weighted hit is higher because
    # long contexts are late turns with high hit, so it offers fewer delta bytes.
    grown = generate(session_spec())
    uniform = generate(session_spec(hit_rate=HitRateDist(kind="uniform", lo=0.85, hi=0.95)))
    assert np.array_equal(grown.input_tokens, uniform.input_tokens)
    assert abs(grown.hit_rate.mean() - uniform.hit_rate.mean()) < 0.02
    d_grown = (grown.input_tokens - grown.cached_tokens).sum()
    d_uniform = (uniform.input_tokens - uniform.cached_tokens).sum()
    assert d_grown < 0.85 * d_uniform


def test_turns_grow_the_context_and_cache_the_previous_prompt() -> None:
    ctx = ContextGrowth(max_context_tokens=131_072)
    rng = np.random.default_rng(0)
    inputs, cached = ctx.grow(rng, np.array([3]), np.array([100, 200, 300]))
    assert cached[0] == ctx.shared_prefix_tokens
    assert cached[1] == inputs[0] and cached[2] == inputs[1]
    assert inputs[1] > inputs[0] + 100 - 1  # previous output + appended tokens


def test_session_hit_needs_a_context_model() -> None:
    with pytest.raises(ValueError, match="context"):
        WorkloadSpec(hit_rate=HitRateDist(kind="session"))
