"""In-DC PD on real agents: an MD in P's own datacenter gets the KV over the intra-DC fabric
(no WAN bytes), with the same greedy tokens as `single`."""

from __future__ import annotations

import pytest
from agent_node_helpers import make_prompt, pdd_body, run_single, stream_events, summarize

pytestmark = pytest.mark.slow
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # baton-tiny: K and V, 4 layers, 2 KV heads, dim 64, f32


def test_md_in_the_prefill_datacenter_gets_its_kv_over_the_intra_dc_fabric(cluster):
    # The cluster's reference engine is a main-decode instance in dc-a, P's datacenter.
    md, p = cluster["single"], cluster["p"]
    prompt = make_prompt(120, 81)
    expected = run_single(md, prompt, 10)["output_token_ids"]
    body = pdd_body("in-dc", prompt, 10, "p-md", "one-shot", p, None, md)
    body["main"]["datacenter"] = "dc-a"
    events, _, _ = stream_events(f"{p.http}/v1/pdd/generate", body)
    result = summarize(events)
    assert result["error"] is None, result["error"]
    assert result["output_token_ids"] == expected
    stats = result["stats"]
    assert stats["kv_bytes"]["wan"] == 0
    # Whatever MD's cache held already (it ran the same prompt just now), the delta went intra-DC.
    assert stats["kv_bytes"]["intra_dc"] > 0
    assert stats["kv_wire_bytes"]["intra_dc"] >= stats["kv_bytes"]["intra_dc"]
