"""The gateway's CPU per relayed token: a streamed request's events from a stand-in prefill
agent (no network, no engine) through the run (stall deadline, text assembly, logprobs off)
and the OpenAI chunk framing, as the view streams them; the record written at the end.

Scenario (fixed before the first run): completions requests of 16, 256 and 3,000 tokens of
ASCII text from the byte tokenizer, 5 rounds, each round running every length once in turn;
the figure is microseconds per token (wall time of one request / its tokens), median and
spread over the rounds. One process, embedded defaults (SQLite test database in memory).
Run:
    .venv/bin/python -m bench.gateway_relay --out var/gw/relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench.harness.inprocess import setup_test_database
from bench.harness.output import publish, spread
from pdd.vocab import HandoffMode, Pipeline

LENGTHS = (16, 256, 3000)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    setup_test_database()

    from billing import services as billing
    from billing.models import Tenant
    from fleet.models import ServedModel
    from pdd.policy import Decision
    from pdd.tokenizer import ByteTokenizer
    from routing.gateway import run as gw_run
    from routing.gateway import views
    from routing.gateway.parsing import GatewayRequest

    tenant = Tenant.objects.create(name="bench")
    key, _ = billing.api_key_create(tenant=tenant)
    model = ServedModel.objects.create(
        name="baton-tiny", source="baton-tiny", num_layers=4, kv_bytes_per_token=4096
    )

    async def events(url, plan):
        for i in range(plan["max_tokens"]):
            yield {"type": "token", "index": i, "token_id": 97 + i % 26, "role": "md"}
        yield {"type": "done", "finish_reason": "length", "stats": {"cached_tokens": 0}}

    gw_run.run_events = events

    def prepared(request_id: str, tokens: int) -> views.Prepared:
        return views.Prepared(
            key=key,
            greq=GatewayRequest(
                endpoint="completions",
                model="baton-tiny",
                prompt_text="hi",
                max_tokens=tokens,
                temperature=0.0,
                top_p=1.0,
                stream=True,
                include_usage=True,
                seed=None,
            ),
            model=model,
            tokenizer=ByteTokenizer(),
            prompt_ids=[104, 105],
            request_id=request_id,
            decision=Decision(
                Pipeline.P_MD, HandoffMode.ONE_SHOT, "1", None, "2", 0, 2, 0.01, "bench"
            ),
            version=1,
            inputs={},
            kind="completions",
            url="http://p.invalid/v1/pdd/generate",
            plan={"request_id": request_id, "max_tokens": tokens},
        )

    async def one(request_id: str, tokens: int) -> float:
        p = prepared(request_id, tokens)
        t0 = time.perf_counter()
        async for _ in views.stream_body(p):
            pass
        return (time.perf_counter() - t0) / tokens * 1e6

    per_token: dict[int, list[float]] = {n: [] for n in LENGTHS}
    asyncio.run(one("warm-up", 64))
    for r in range(args.rounds):
        for n in LENGTHS:
            per_token[n].append(asyncio.run(one(f"relay-{r}-{n}", n)))
    result = {
        "rounds": args.rounds,
        "us_per_token": {str(n): spread(v, 2) for n, v in per_token.items()},
    }
    publish(result, args.out)
    return result


if __name__ == "__main__":
    main()
