"""Where an engine runs: the device setting, its errors, and (with a GPU) CPU/GPU agreement.

The CUDA tests run only where torch sees a GPU; the rest of the engine suite runs on a GPU
too when BATON_ENGINE_DEVICE=cuda is set (EngineConfig's default device comes from it).
"""

from __future__ import annotations

import pytest
import torch

from agents.engine import Engine, EngineConfig, SamplingParams, build_baton_tiny
from agents.node.settings import AgentSettings, load_settings

GREEDY_24 = SamplingParams(max_tokens=24)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_default_device_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("BATON_ENGINE_DEVICE", raising=False)
    assert EngineConfig().device == "cpu"
    monkeypatch.setenv("BATON_ENGINE_DEVICE", "cuda:1")
    assert EngineConfig().device == "cuda:1"
    assert EngineConfig().torch_device == torch.device("cuda", 1)
    assert EngineConfig(device="cpu").device == "cpu"  # an explicit setting wins


@pytest.mark.parametrize("bad", ["tpu", "gpu", "", "cuda:x"])
def test_an_unknown_device_is_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match="EngineConfig.device must be cpu, cuda or cuda:N"):
        EngineConfig(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_engine_without_a_gpu_fails_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        Engine(build_baton_tiny(0), EngineConfig(num_blocks=8, device="cuda"))


def test_the_agent_takes_a_device_and_checks_it() -> None:
    assert AgentSettings().device is None  # the engine's default ($BATON_ENGINE_DEVICE or cpu)
    assert load_settings(None, {"device": "cuda:0"}).device == "cuda:0"
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        load_settings(None, {"device": "gpu"})


@cuda
def test_a_gpu_engine_decodes_what_the_cpu_engine_decodes(prompt) -> None:
    cpu = Engine(build_baton_tiny(0), EngineConfig(num_blocks=64, device="cpu"))
    gpu = Engine(build_baton_tiny(0), EngineConfig(num_blocks=64, device="cuda"))
    assert gpu.pool.k_cache.is_cuda and next(gpu.model.parameters()).is_cuda
    expected = cpu.generate(prompt, GREEDY_24)
    assert gpu.generate(prompt, GREEDY_24) == expected
    # the second turn reuses the GPU engine's own cached prefix
    warm = gpu.generate(prompt, GREEDY_24)
    assert warm.cached_tokens == 32 and warm.output_ids == expected.output_ids


@cuda
def test_kv_shipped_from_a_gpu_prefill_decodes_on_a_cpu_engine_and_back(prompt) -> None:
    expected = Engine(build_baton_tiny(0), EngineConfig(num_blocks=64, device="cpu")).generate(
        prompt, GREEDY_24
    )
    for src, dst in (("cuda", "cpu"), ("cpu", "cuda")):
        sender = Engine(build_baton_tiny(0), EngineConfig(num_blocks=64, device=src))
        receiver = Engine(build_baton_tiny(0), EngineConfig(num_blocks=64, device=dst))
        first = sender.prefill("req", prompt, GREEDY_24)
        payload = sender.export_kv("req", 0, len(prompt))
        sender.release("req")
        receiver.import_prefix("req", prompt, 0, payload)
        receiver.start_decode("req", prompt, first.first_token, GREEDY_24)
        tokens = [first.first_token]
        while receiver.has_work():
            for out in receiver.step():
                tokens.extend(out.token_ids)
        assert tokens == expected.output_ids, f"{src} -> {dst}"
