"""The model's forward over the paged pool: cached positions plus k new ones per request."""

from __future__ import annotations

import torch

from agents.engine import LoadedModel, PagedKVPool
from agents.engine.batch import SeqChunk, build_forward_batch

BS = 16


def _pool(tiny: LoadedModel, num_blocks: int = 32) -> PagedKVPool:
    """A pool where the shared model is (engines move it: BATON_ENGINE_DEVICE=cuda runs)."""
    cfg = tiny.config
    device = tiny.model.lm_head.weight.device
    return PagedKVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, BS, device=device
    )


def _forward(tiny: LoadedModel, pool: PagedKVPool, chunks: list[SeqChunk]) -> torch.Tensor:
    batch = build_forward_batch(chunks, BS).to(pool.device)
    return tiny.model(batch, pool.k_cache, pool.v_cache).cpu()  # [T, vocab]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_then_single_token_decodes_equal_one_full_forward(tiny: LoadedModel) -> None:
    ids = _ids(40, seed=0)
    pool = _pool(tiny)
    full = _forward(tiny, pool, [SeqChunk(ids, 0, pool.allocate(3))])  # [40, vocab]
    table = pool.allocate(3)
    rows = [_forward(tiny, pool, [SeqChunk(ids[:33], 0, table)])]
    for pos in range(33, 40):
        rows.append(_forward(tiny, pool, [SeqChunk(ids[pos : pos + 1], pos, table)]))
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-4, rtol=1e-4)


def test_extend_of_k_tokens_equals_k_decode_steps(tiny: LoadedModel) -> None:
    ids = _ids(60, seed=1)
    prompt, handed_over = ids[:24], ids[24:]  # k = 36 known tokens crossing two block borders
    pool = _pool(tiny)
    one_shot, stepwise = pool.allocate(4), pool.allocate(4)
    _forward(tiny, pool, [SeqChunk(prompt, 0, one_shot)])
    _forward(tiny, pool, [SeqChunk(prompt, 0, stepwise)])
    extended = _forward(tiny, pool, [SeqChunk(handed_over, 24, one_shot)])[-1]
    for i, token in enumerate(handed_over):
        last = _forward(tiny, pool, [SeqChunk([token], 24 + i, stepwise)])[-1]
    torch.testing.assert_close(extended, last, atol=1e-4, rtol=1e-4)
    assert int(extended.argmax()) == int(last.argmax())
    # The KV written by the one extend equals the KV written step by step.
    k, v = pool.k_cache.flatten(1, 2), pool.v_cache.flatten(1, 2)  # [L, slots, KVH, D]
    a, b = pool.slots(one_shot, 0, 60), pool.slots(stepwise, 0, 60)
    torch.testing.assert_close(k[:, a], k[:, b], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v[:, a], v[:, b], atol=1e-5, rtol=1e-5)


def test_varlen_batch_equals_each_request_alone(tiny: LoadedModel) -> None:
    # (cached_len, extend_len): a fresh prompt, a decode step, a mid-sequence extend.
    shapes = [(0, 21), (37, 1), (16, 9)]
    seqs = [_ids(c + e, seed=10 + i) for i, (c, e) in enumerate(shapes)]
    pool = _pool(tiny, num_blocks=64)
    tables = [pool.allocate(3) for _ in shapes]
    alone_tables = [pool.allocate(3) for _ in shapes]
    for seq, (cached, _), t, ta in zip(seqs, shapes, tables, alone_tables, strict=True):
        if cached:
            _forward(tiny, pool, [SeqChunk(seq[:cached], 0, t)])
            _forward(tiny, pool, [SeqChunk(seq[:cached], 0, ta)])
    batched = _forward(
        tiny,
        pool,
        [SeqChunk(s[c:], c, t) for s, (c, _), t in zip(seqs, shapes, tables, strict=True)],
    )
    alone = torch.cat(
        [
            _forward(tiny, pool, [SeqChunk(s[c:], c, t)])
            for s, (c, _), t in zip(seqs, shapes, alone_tables, strict=True)
        ]
    )
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


def test_forward_batch_masks_causally_inside_the_new_tokens() -> None:
    # Positions 0..3 live in block 3 (slots 12..15), position 4 in block 0 (slot 0).
    batch = build_forward_batch([SeqChunk([5, 6, 7], 2, [3, 0])], block_size=4)
    assert batch.positions.tolist() == [2, 3, 4]
    assert batch.write_slots.tolist() == [14, 15, 0]
    assert batch.read_slots.tolist() == [[12, 13, 14, 15, 0]]
    mask = batch.attn_mask[0, 0].int().tolist()  # [Q=3, K=5]
    assert mask == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
