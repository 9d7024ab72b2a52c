"""An instance's own dtype (PUT /instances/{id} "dtype", sent by the control plane from its
served model): it builds the instance's engine, defaults to the agent's --dtype, is part of the
instance's spec (another dtype for a live id is a 409), is refused naming the field when
unknown, and the agent's checkpoint cache keeps one copy per (source, dtype)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from agents.engine import SamplingParams
from agents.node.agent import Agent
from agents.node.errors import AgentError
from agents.node.http_api import build_app
from agents.node.instances import Instance
from agents.node.settings import AgentSettings

PROMPT = [32 + (i * 5) % 90 for i in range(20)]
SPEC = {"role": "main_decode", "model": "baton-tiny", "source": "baton-tiny"}


def _run(settings: AgentSettings, scenario):
    """Run `scenario(agent, http)` against an in-process agent and its HTTP API."""

    async def main():
        agent = Agent(settings)
        transport = httpx.ASGITransport(app=build_app(agent))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
                return await scenario(agent, http)
        finally:
            await agent.close()

    return asyncio.run(main())


async def _put(agent: Agent, http: httpx.AsyncClient, iid: str, **extra) -> Instance:
    response = await http.put(f"/instances/{iid}", json={**SPEC, **extra})
    assert response.status_code == 200, response.text
    inst = agent.instances[iid]
    await asyncio.wait_for(inst.ready.wait(), 120)
    assert inst.worker is not None, inst.error
    return inst


async def _generate(inst: Instance) -> list[int]:
    return await inst.running_worker.call(
        lambda e: e.generate(PROMPT, SamplingParams(max_tokens=3)).output_ids
    )


def test_a_put_dtype_builds_the_engine_and_the_cache_keeps_the_dtypes_apart():
    async def scenario(agent: Agent, http: httpx.AsyncClient):
        f32 = await _put(agent, http, "1")  # no dtype: the agent's own (float32)
        bf16 = await _put(agent, http, "2", dtype="bfloat16")
        f32_again = await _put(agent, http, "3", dtype="float32")
        instances = (f32, bf16, f32_again)
        tokens = [await _generate(inst) for inst in instances]
        state = (await http.get("/state")).json()
        engines = [inst.running_worker.engine for inst in instances]
        return agent, engines, tokens, state

    agent, engines, tokens, state = _run(AgentSettings(num_blocks=64), scenario)
    e32, e16, e32b = engines
    assert e16.config.dtype == "bfloat16"
    assert e16.model.lm_head.weight.dtype == torch.bfloat16
    assert e16.pool.k_cache.dtype == torch.bfloat16
    # Engines cast a shared model in place: the bfloat16 instance must not have touched the
    # float32 one's weights, and float32 instances share one copy.
    assert e32.config.dtype == "float32"
    assert e32.model.lm_head.weight.dtype == torch.float32
    assert e32.pool.k_cache.dtype == torch.float32
    assert e16.model is not e32.model
    assert e32b.model is e32.model
    assert set(agent.instances._models) == {("baton-tiny", "float32"), ("baton-tiny", "bfloat16")}
    assert all(len(t) == 3 for t in tokens)
    assert tokens[0] == tokens[2]  # the same weights, the same greedy tokens
    dtypes = {item["instance_id"]: item["dtype"] for item in state["instances"]}
    assert dtypes == {"1": "float32", "2": "bfloat16", "3": "float32"}
    assert state["engine_options"]["dtype"] == "float32"  # the agent's default is unchanged


def test_no_dtype_is_the_agents_own_and_another_dtype_for_a_live_id_is_a_409():
    async def scenario(agent: Agent, http: httpx.AsyncClient):
        inst = await _put(agent, http, "7")  # the agent runs --dtype bfloat16
        first = inst.running_worker.engine
        answers = {
            "same, explicit": await http.put("/instances/7", json={**SPEC, "dtype": "bfloat16"}),
            "same, null": await http.put("/instances/7", json={**SPEC, "dtype": None}),
            "other": await http.put("/instances/7", json={**SPEC, "dtype": "float32"}),
        }
        await http.delete("/instances/7")
        restarted = await _put(agent, http, "7", dtype="float16")  # a new spec after a stop
        engines = (first, restarted.running_worker.engine)
        return inst, answers, engines

    settings = AgentSettings(num_blocks=64, dtype="bfloat16")
    inst, answers, (first, restarted) = _run(settings, scenario)
    assert inst.dtype == "bfloat16"
    assert first.model.lm_head.weight.dtype == torch.bfloat16
    assert answers["same, explicit"].status_code == 200
    assert answers["same, explicit"].json()["dtype"] == "bfloat16"
    assert answers["same, null"].status_code == 200
    assert answers["other"].status_code == 409
    assert "float32" in answers["other"].json()["error"]
    assert restarted.model.lm_head.weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", ["float64", "int8", "", 16, True])
def test_a_bad_dtype_is_a_400_naming_the_field(dtype):
    async def scenario(agent: Agent, http: httpx.AsyncClient):
        response = await http.put("/instances/9", json={**SPEC, "dtype": dtype})
        return response, dict(agent.instances)

    response, instances = _run(AgentSettings(num_blocks=64), scenario)
    assert response.status_code == 400
    body = response.json()
    assert body["field"] == "dtype"
    assert body["error"].startswith("dtype: ")
    if isinstance(dtype, str) and dtype:
        assert "['float32', 'bfloat16', 'float16']" in body["error"]
    assert instances == {}  # nothing started


def test_an_in_process_put_checks_the_dtype_too():
    async def scenario(agent: Agent, http: httpx.AsyncClient):
        with pytest.raises(AgentError) as caught:
            await agent.instances.put("9", "prefill", "baton-tiny", "baton-tiny", dtype="half")
        return caught.value

    exc = _run(AgentSettings(num_blocks=64), scenario)
    assert (exc.status, exc.field) == (400, "dtype")
    assert exc.message == "dtype must be one of ['float32', 'bfloat16', 'float16'], got 'half'"
