"""The WAN link's KV format reaches P: the plan names it on the main decoder across the link
(and only there: an MD in P's own datacenter gets the engine's own format)."""

from __future__ import annotations

from pdd.policy import ClusterSnapshot, Decision
from routing.gateway.runner import Sampling, build_plan
from routing.live import Endpoint, LiveView


def _view(kv_formats):
    endpoints = {
        "p": Endpoint("p", "prefill", "dc-a", "http://p:1", "p", 2, 3),
        "md": Endpoint("md", "main_decode", "dc-b", "http://md:1", "md", 2, 3),
        "md-local": Endpoint("md-local", "main_decode", "dc-a", "http://m2:1", "m2", 2, 3),
    }
    return LiveView(snapshot=ClusterSnapshot(), endpoints=endpoints, kv_formats=kv_formats)


def _plan(view, main_id: str):
    decision = Decision("p-md", "none", "p", None, main_id, 0, 64, 0.1, "test")
    sampling = Sampling(max_tokens=4, temperature=0.0, top_p=1.0, seed=None)
    _, body = build_plan(request_id="r", prompt_ids=[1] * 64, sampling=sampling,
                         decision=decision, view=view)  # fmt: skip
    return body


def test_the_plan_carries_the_links_kv_format_to_p():
    view = _view({("dc-a", "dc-b"): "int8"})
    assert _plan(view, "md")["main"]["kv_format"] == "int8"
    assert "kv_format" not in _plan(view, "md-local")["main"]  # same datacenter: no WAN
    assert "kv_format" not in _plan(_view({}), "md")["main"]  # the engine's own
