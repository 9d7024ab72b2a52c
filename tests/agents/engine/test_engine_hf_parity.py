"""Our loader + model against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from agents.engine import PagedKVPool, load_hf_checkpoint, load_model
from agents.engine.batch import SeqChunk, build_forward_batch

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "llama3_rope":
        cfg = transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE, rope_theta=5e5)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    # HF's init leaves biases at 0 and norms at 1; randomise everything so each weight counts.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model.eval()


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    pool = PagedKVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=8, block_size=8)
    batch = build_forward_batch([SeqChunk(ids, 0, pool.allocate(pool.blocks_for(len(ids))))], 8)
    return model(batch, pool.k_cache, pool.v_cache)


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2"])
def test_logits_match_transformers(kind: str, tmp_path) -> None:
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_hf_checkpoint(tmp_path)
    ids = torch.randint(0, 97, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]  # [37, vocab]
    got = _our_logits(loaded.model, ids.tolist())
    assert expected.abs().max() > 1.0  # not a trivially small comparison
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_qwen2_loads_qkv_biases_and_ties_the_lm_head(tmp_path) -> None:
    _hf_model("qwen2").save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf_checkpoint(tmp_path).model
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is None) == (True, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_loads_through_its_index(tmp_path) -> None:
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = list(range(20))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(
        _our_logits(load_model(str(tmp_path)).model, ids), expected, atol=1e-4, rtol=1e-4
    )


def test_missing_folder_is_a_one_line_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown model") as err:
        load_model(str(tmp_path / "absent"))
    assert "\n" not in str(err.value)


def test_unsupported_architecture_is_a_value_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))
