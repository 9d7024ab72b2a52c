"""Log-probabilities of the sampled tokens (SamplingParams.logprobs): the raw model
distribution, i.e. the log-softmax of the model's own logits for the same positions, checked
against one full forward over prompt + output; nothing extra when not asked for."""

from __future__ import annotations

import math

import pytest
import torch

from agents.engine import Engine, LoadedModel, PagedKVPool, SamplingParams
from agents.engine.batch import SeqChunk, build_forward_batch

ATOL = 1e-4  # the engine decodes incrementally over its KV cache; the reference in one forward


def _reference_logp(tiny: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `ids`, in one forward: row t
    is the distribution of token t + 1."""
    cfg, bs = tiny.config, 16
    device = tiny.model.lm_head.weight.device
    pool = PagedKVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-len(ids) // bs) + 1, bs, device=device
    )
    batch = build_forward_batch([SeqChunk(ids, 0, pool.allocate(-(-len(ids) // bs)))], bs)
    with torch.inference_mode():
        logits = tiny.model(batch.to(device), pool.k_cache, pool.v_cache).cpu().float()
    return torch.log_softmax(logits, dim=-1)  # [T, vocab]


def _check_against_reference(tiny, prompt, output_ids, logprobs, k):
    ref = _reference_logp(tiny, [*prompt, *output_ids])
    assert len(logprobs) == len(output_ids)
    for j, (token, lp) in enumerate(zip(output_ids, logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert math.isclose(lp.logprob, float(row[token]), abs_tol=ATOL), j
        assert len(lp.top) == k
        for t, v in lp.top:  # each listed token's own logprob (ties may order ids apart)
            assert math.isclose(v, float(row[t]), abs_tol=ATOL)
        for (_, v), ref_v in zip(lp.top, row.topk(k).values.tolist(), strict=True):
            assert math.isclose(v, ref_v, abs_tol=ATOL)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_greedy_logprobs_are_the_models_log_softmax(tiny, engine_config, prompt, k):
    result = Engine(tiny, engine_config).generate(
        prompt, SamplingParams(max_tokens=12, logprobs=k, ignore_eos=True)
    )
    _check_against_reference(tiny, prompt, result.output_ids, result.logprobs, k)
    for token, lp in zip(result.output_ids, result.logprobs, strict=True):
        assert lp.logprob <= 0.0
        if k:  # greedy: the sampled token is the most likely one
            assert lp.top[0][0] == token
            assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)


def test_sampled_logprobs_are_the_raw_distribution_not_the_tempered_one(
    tiny, engine_config, prompt
):
    sampling = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, seed=7, logprobs=3)
    result = Engine(tiny, engine_config).generate(prompt, sampling)
    _check_against_reference(tiny, prompt, result.output_ids, result.logprobs, 3)
    # The same seed without logprobs samples the same tokens: asking changes nothing else.
    plain = Engine(tiny, engine_config).generate(
        prompt, SamplingParams(max_tokens=10, temperature=1.5, top_p=0.9, seed=7)
    )
    assert plain.output_ids == result.output_ids
    assert plain.logprobs is None


def test_not_asking_costs_nothing_and_returns_none(tiny, engine_config, prompt):
    engine = Engine(tiny, engine_config)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4))
    engine.add_request("b", prompt[:30], SamplingParams(max_tokens=4, logprobs=2))
    seen: dict[str, list] = {"a": [], "b": []}
    while engine.has_work():
        for out in engine.step():
            seen[out.request_id].append(out.logprobs)
    assert all(lp is None for lp in seen["a"])
    assert all(lp is not None and len(lp) == 1 and len(lp[0].top) == 2 for lp in seen["b"])


def test_prefill_and_a_handoffs_extend_return_logprobs(tiny, engine_config, prompt):
    """P's first token (prefill), RLD's decode and MD's first token after the handoff (the
    extend) each carry the logprob of the full model at their position."""
    asked = SamplingParams(max_tokens=16, logprobs=4, ignore_eos=True)
    p = Engine(tiny, engine_config)
    pre = p.prefill("req", prompt, asked)
    payload = p.export_kv("req", 0, len(prompt))
    rld, md = Engine(tiny, engine_config), Engine(tiny, engine_config)
    for engine in (rld, md):
        engine.import_prefix("req", prompt, 0, payload)
    rld.start_decode("req", prompt, pre.first_token, asked)
    ids, lps = [pre.first_token], [pre.first_logprob]
    while len(ids) < 6:
        (out,) = rld.step()
        ids += out.token_ids
        lps += out.logprobs
    rld.release("req")
    md.start_decode("req", prompt, pre.first_token, asked, hold=True)
    nxt = md.extend("req", ids[1:])
    ids += nxt.token_ids
    lps += nxt.logprobs
    while md.has_work():
        for out in md.step():
            ids += out.token_ids
            lps += out.logprobs
    assert len(ids) == 16
    _check_against_reference(tiny, prompt, ids, lps, 4)


def test_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
