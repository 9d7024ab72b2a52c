"""The agent passes its engine options (--dtype, --decode-weights, --decode-compile) to every
engine it starts,
reports them (state document, /health, pdd_engine_info) and refuses bad values in one line."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agents.engine import SamplingParams
from agents.node.agent import Agent
from agents.node.http_api import build_app
from agents.node.settings import AgentSettings

PROMPT = [32 + (i * 7) % 90 for i in range(24)]


def _start(settings: AgentSettings):
    async def main():
        agent = Agent(settings)
        try:
            inst = await agent.instances.put("0", "relay_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            assert inst.worker is not None, inst.error
            engine = inst.worker.engine
            tokens = await inst.worker.call(
                lambda e: e.generate(PROMPT, SamplingParams(max_tokens=4)).output_ids
            )
            transport = httpx.ASGITransport(app=build_app(agent))
            async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
                health = (await http.get("/health")).json()
                metrics = (await http.get("/metrics")).text
            return engine, tokens, agent.reporting.state(), health, metrics
        finally:
            await agent.close()

    return asyncio.run(main())


def test_the_agent_builds_its_engines_with_its_dtype_and_decode_weights():
    settings = AgentSettings(num_blocks=64, node="n-1", dtype="bfloat16", decode_weights="int8")
    engine, tokens, state, health, metrics = _start(settings)
    assert engine.config.dtype == "bfloat16"
    assert engine.config.decode_weights == "int8"
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.pool.k_cache.dtype == torch.bfloat16
    assert engine.runner.decode_int8
    assert len(tokens) == 4
    options = {"device": "cpu", "dtype": "bfloat16", "decode_weights": "int8"}
    assert state["engine_options"] == options
    assert health["engine_options"] == options
    assert (
        'pdd_engine_info{node="n-1",datacenter="dc-a",device="cpu",dtype="bfloat16",'
        'decode_weights="int8"} 1.0'
    ) in metrics


def test_the_agent_passes_stream_decode_weights_to_its_engines():
    """--decode-weights stream: the engines multiply by the skinny kernel's copies (where the
    CPU runs it; elsewhere they keep the default linears), and the agent reports the option."""
    settings = AgentSettings(num_blocks=64, node="n-1", decode_weights="stream")
    engine, tokens, state, health, _metrics = _start(settings)
    assert engine.config.decode_weights == "stream" and engine.runner.decode_stream
    assert len(tokens) == 4
    assert state["engine_options"]["decode_weights"] == "stream"
    assert health["engine_options"]["decode_weights"] == "stream"


def test_the_defaults_are_float32_with_the_models_own_weights():
    engine, _tokens, state, health, _metrics = _start(AgentSettings(num_blocks=64))
    assert engine.config.dtype == "float32" and engine.config.decode_weights is None
    assert engine.model.lm_head.weight.dtype == torch.float32
    assert not engine.runner.decode_int8
    assert state["engine_options"]["dtype"] == "float32"
    assert health["engine_options"]["decode_weights"] == "full"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of float32|bfloat16|float16, got 'float64'"),
        (
            {"decode_weights": "int4"},
            "decode_weights must be one of full|int8|stream, got 'int4'",
        ),
        ({"decode_compile": "yes"}, "decode_compile must be true or false, got 'yes'"),
        (
            {"decode_compile": True, "device": "cuda"},
            "decode_compile runs on the CPU only, not device 'cuda'",
        ),
        (
            {"decode_compile": True, "decode_weights": "int8"},
            "decode_compile runs with the model's own weights (decode_weights full)",
        ),
        (
            {"decode_weights": "int8", "device": "cuda"},
            "decode_weights int8 runs on the CPU only, not device 'cuda'",
        ),
        (
            {"decode_weights": "stream", "device": "cuda"},
            "decode_weights stream runs on the CPU only, not device 'cuda'",
        ),
    ],
)
def test_bad_engine_options_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(ValueError) as exc:
        AgentSettings(**kwargs)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "half"], "argument --dtype: invalid choice: 'half'"),
        (["--decode-weights", "int4"], "argument --decode-weights: invalid choice: 'int4'"),
        (
            ["--decode-weights", "int8", "--device", "cuda:0"],
            "decode_weights int8 runs on the CPU only, not device 'cuda'",
        ),
    ],
)
def test_bad_engine_flags_are_a_one_line_usage_error(argv, message, capsys):
    from agents.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_decode_compile_reaches_the_engine_and_is_reported_only_when_on(monkeypatch):
    from agents.node.settings import load_settings

    settings = load_settings(None, {"decode_compile": True, "dtype": None})
    assert settings.decode_compile is True
    assert settings.engine_options() == {
        "device": "cpu", "dtype": "float32", "decode_weights": "full", "decode_compile": True,
    }  # fmt: skip
    assert "decode_compile" not in AgentSettings().engine_options()
    # The flag: absent leaves the setting (None is dropped), present turns it on.
    import argparse

    from agents.__main__ import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).decode_compile is None
    assert parser.parse_args(["serve", "--decode-compile"]).decode_compile is True
    # The engine the agent builds runs its decode steps compiled (torch.compile is mocked
    # here: compiling takes tens of seconds; tests/agents/engine/test_engine_decode_compile.py
    # compiles for real).
    calls = []
    from agents.engine import model_runner

    real = model_runner.decode_forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("compiled"))
        kwargs["compiled"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "decode_forward", spy)
    engine, tokens, state, health, _metrics = _start(
        AgentSettings(num_blocks=64, node="n-1", decode_compile=True)
    )
    assert engine.config.decode_compile is True and len(tokens) == 4
    assert calls and all(calls)  # every decode step asked for the compiled step
    assert state["engine_options"]["decode_compile"] is True
    assert health["engine_options"]["decode_compile"] is True


def test_a_config_file_sets_the_engine_options(tmp_path):
    from agents.node.settings import load_settings

    path = tmp_path / "agent.json"
    path.write_text('{"dtype": "bfloat16", "decode_weights": "int8"}')
    settings = load_settings(str(path), {"dtype": None})
    assert (settings.dtype, settings.decode_weights) == ("bfloat16", "int8")
    path.write_text('{"dtype": "fp8"}')
    with pytest.raises(ValueError, match="dtype must be one of float32|bfloat16|float16"):
        load_settings(str(path), {})
