"""The PyTorch engine one agent thread drives: a real model over a paged KV pool of tensors.
Continuous batching and the prefill / export / import / extend calls the PDD pipelines are built
from are the engine core's (agents/engine/core.py); the model, its forward pass and sampling are
here. Not thread-safe."""

from __future__ import annotations

import logging
from typing import Any

import torch

from agents.engine import skinny
from agents.engine.config import EngineConfig
from agents.engine.core import EngineCore
from agents.engine.decode import fuse_projections
from agents.engine.interface import TORCH
from agents.engine.kv_pool import PagedKVPool
from agents.engine.loader import LoadedModel, load_model
from agents.engine.model import CausalLM
from agents.engine.model_runner import ModelRunner
from agents.engine.outputs import (
    TokenLogprob,
    TokenOutput,
)
from agents.engine.radix_cache import RadixCache
from agents.engine.request import (
    AfterForward,
    Request,
    SamplingParams,
)
from agents.engine.sampler import sample_tokens, token_logprobs
from agents.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Engine(EngineCore):
    """One model, one paged KV pool, one radix prefix cache (agents/engine/interface.py)."""

    kind = TORCH

    def __init__(self, model: CausalLM | LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.tokenizer = model.tokenizer if isinstance(model, LoadedModel) else None
        model = model.model if isinstance(model, LoadedModel) else model
        dtype = self.config.torch_dtype
        device = self.config.torch_device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"EngineConfig.device {self.config.device!r}: torch sees no CUDA device "
                "(this torch build or machine has none; use device 'cpu')"
            )
        # Casting and moving are in place, so engines sharing a model must share its dtype and
        # device too.
        weight = model.lm_head.weight
        if weight.dtype != dtype or weight.device != device:
            model = model.to(device=device, dtype=dtype)
        fuse_projections(model)  # q/k/v and gate/up as views of fused weights (decode.py)
        self.model = model
        cfg = model.config
        self.model_config = cfg
        self.pool = PagedKVPool(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.config.num_blocks,
            self.config.block_size,
            dtype,
            device,
        )
        self.cache = RadixCache(self.config.block_size)
        self.scheduler = Scheduler(self.config, self.pool, self.cache)
        self.runner = ModelRunner(
            self.model,
            self.pool,
            decode_int8=self.config.decode_weights == "int8",
            decode_packed=self.config.decode_weights == "packed",
            decode_stream=self.config.decode_weights == "stream",
            decode_compile=self.config.decode_compile,
        )
        if self.config.decode_weights == "stream" and not skinny.available():
            log.warning(
                "decode_weights='stream': the skinny kernel does not run here (%s); decode "
                "steps use the default linears",
                skinny.unavailable_reason(),
            )
        self.requests: dict[str, Request] = {}
        self._undelivered: list[TokenOutput] = []
        self._init_counters()

    @classmethod
    def from_spec(cls, spec: str, config: EngineConfig | None = None) -> Engine:
        """Engine over "baton-tiny" or a Hugging Face checkpoint folder."""
        config = config or EngineConfig()
        return cls(load_model(spec, config.torch_dtype, config.seed), config)

    def represented_bytes(self, payload: bytes) -> int:
        """The KV bytes a payload stands for: all of it (agents/engine/interface.py)."""
        return len(payload)

    def describe(self) -> dict[str, Any]:
        """What this engine is, for the agent's state document."""
        return {"kind": TORCH, "dtype": self.config.dtype, "device": self.config.device}

    # -- the forward pass ----------------------------------------------------------------------

    def _step_once(self) -> list[TokenOutput] | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        logits = self.runner.run(batch.requests, batch.num_tokens)  # [m, vocab]
        self._forwards += 1
        self._tokens_computed += sum(batch.num_tokens)
        complete = [r for r in batch.requests if r.extend_len == 0]
        assert logits.shape[0] == len(complete), "one logits row per completed request"
        sampled = [i for i, r in enumerate(complete) if r.after_forward != AfterForward.HOLD]
        tokens = sample_tokens(
            logits[sampled],
            [complete[i].sampling for i in sampled],
            [complete[i].generator for i in sampled],
        )
        # Log-probabilities only for the requests that asked (SamplingParams.logprobs).
        asking = [j for j, i in enumerate(sampled) if complete[i].sampling.logprobs is not None]
        logprobs: dict[int, TokenLogprob] = {}
        if asking:
            rows = [sampled[j] for j in asking]
            found = token_logprobs(
                logits[rows],
                [tokens[j] for j in asking],
                [complete[i].sampling.logprobs for i in rows],
            )
            logprobs = dict(zip(rows, found, strict=True))
        return self._deliver(complete, sampled, tokens, logprobs)

    def _generator(self, sampling: SamplingParams, arrival: int) -> torch.Generator | None:
        if sampling.greedy:
            return None
        return torch.Generator().manual_seed(self._sampling_seed(sampling, arrival))
