"""The agent's GET /metrics: its instances' engine figures under vLLM's names and its node-wide
fabric and token counters, labelled by instance and role, read from the state document."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agents.engine import SamplingParams
from agents.node.agent import Agent
from agents.node.http_api import build_app
from agents.node.settings import AgentSettings
from pdd.metrics import Family, render, state_families

PROMPT = [32 + (i * 7) % 90 for i in range(40)]


def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_serve_the_instances_figures_as_the_state_document_has_them():
    async def main():
        agent = Agent(AgentSettings(block_size=16, num_blocks=128, node="n-1", datacenter="dc-a"))
        try:
            inst = await agent.instances.put("7", "main_decode", "baton-tiny", "baton-tiny", 120)
            await asyncio.wait_for(inst.ready.wait(), 120)
            assert inst.worker is not None, inst.error
            for _ in range(2):  # the second finds the first's prefix in the cache
                await inst.worker.call(lambda e: e.generate(PROMPT, SamplingParams(max_tokens=3)))
            await asyncio.sleep(0.6)  # the worker's stats copy is retaken between steps
            transport = httpx.ASGITransport(app=build_app(agent))
            async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
                response = await http.get("/metrics")  # no token: open, like /health
            return response, agent.reporting.state()
        finally:
            await agent.close()

    response, state = asyncio.run(main())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = parse(response.text)
    item = state["instances"][0]
    labels = {
        "model_name": "baton-tiny",
        "instance": "7",
        "role": "main_decode",
        "datacenter": "dc-a",
        "node": "n-1",
        "engine": "torch",
    }

    def value(name: str) -> float:
        (sample,) = families[name].samples
        assert sample.labels == labels, name
        return sample.value

    assert value("vllm:num_requests_running") == item["load"]["running"]
    assert value("vllm:num_requests_waiting") == item["load"]["queued"]
    kv = item["kv"]
    assert value("pdd_kv_blocks_capacity") == kv["total_blocks"] == 128
    assert value("pdd_kv_blocks_used") == kv["used_blocks"]
    assert value("vllm:kv_cache_usage_perc") == kv["used_blocks"] / kv["total_blocks"]
    assert value("vllm:prefix_cache_queries") == item["cache"]["queried_tokens"] > 0
    assert value("vllm:prefix_cache_hits") == item["cache"]["matched_tokens"] > 0
    assert value("pdd_instance_running") == 1
    fabric = {
        (s.labels["fabric"], s.labels["direction"], s.labels["kind"])
        for s in families["pdd_fabric_bytes"].samples
    }
    assert ("wan", "sent", "wire") in fabric and ("intra_dc", "received", "payload") in fabric


def test_render_escapes_labels_and_names_counters_with_total():
    family = Family("x_tokens", "counter", 'a "doc"', ("who",), [(('a"b\\c\nd',), 3.0)])
    gauge = Family("y", "gauge", "g", (), [((), float("inf"))])
    text = render([family, gauge])
    assert 'x_tokens_total{who="a\\"b\\\\c\\nd"} 3.0' in text
    parsed = parse(text)
    assert parsed["x_tokens"].samples[0].labels["who"] == 'a"b\\c\nd'
    assert parsed["y"].samples[0].value == float("inf")


def test_a_state_document_without_engines_yields_families_without_samples():
    families = {
        f.name: f for f in state_families({"node": "n", "instances": [{"state": "starting"}]})
    }
    assert families["vllm:num_requests_running"].samples == []
    assert families["pdd_instance_running"].samples[0][1] == 0.0
