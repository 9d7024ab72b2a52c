"""Shared fixtures for the engine tests: one thread, one baton-tiny build per session."""

from __future__ import annotations

import pytest
import torch

from agents.engine import EngineConfig, LoadedModel, build_baton_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return build_baton_tiny(seed=0)


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(block_size=16, num_blocks=64, max_running=8, max_queued=8)


@pytest.fixture
def prompt(tiny: LoadedModel) -> list[int]:
    # 45 tokens: two whole blocks of 16 and a partial third block.
    ids = tiny.tokenizer.encode("User: tell me about prefill and decode, please.")[:45]
    assert len(ids) == 45
    return ids
