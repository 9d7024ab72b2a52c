"""What the benchmarks send: filler text of an exact token count (baton-tiny's byte tokenizer
and the emulated engines' count one token per ASCII character), a shared system prompt, one
streamed chat completion through the gateway, and the answer an emulated engine gives."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from array import array

import httpx

from pdd.tokenizer import apply_chat_template

WORDS = (
    "agent tool result file diff test build deploy cache prefix relay decode prefill token "
    "request latency bandwidth datacenter router policy handoff batch kernel memory"
).split()
# The system prompt's head on the emulated fleets of the paper model (bench.paper, bench.autopilot).
PAPER_SYSTEM_HEAD = "You are Baton's paper-benchmark agent. "


def filler(rng: random.Random, n: int, pad: bool = True) -> str:
    """`n` characters of words (`pad`: a short last word is padded with dots; else the text
    may be one character short)."""
    out: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    text = " ".join(out)[:n]
    return text.ljust(n, ".") if pad else text


def system_message(shared_tokens: int, head: str) -> dict:
    """The system prompt every session shares: `head`, then filler up to `shared_tokens` with
    the chat template's framing."""
    frame = len(apply_chat_template([{"role": "system", "content": ""}], False))
    rng = random.Random(12345)
    body = head + filler(rng, shared_tokens - frame - len(head))
    return {"role": "system", "content": body}


def tokens_of(messages: list[dict], generation: bool) -> int:
    return len(apply_chat_template(messages, generation).encode("utf-8"))


def emulated_answer(prompt_ids: list[int], n: int) -> list[int]:
    """The tokens an emulated engine answers greedily (a function of the context: blake2b of
    every token so far; agents/engine/emulated.py)."""
    from agents.engine.emulated import token_of

    digest = hashlib.blake2b(digest_size=8)
    digest.update(array("I", prompt_ids).tobytes())
    out = []
    for _ in range(n):
        token = token_of(digest.digest(), None)
        out.append(token)
        digest.update(array("I", [token]).tobytes())
    return out


async def stream_one(http: httpx.AsyncClient, url: str, key: str, model: str,
                     messages: list[dict], max_tokens: int, res: dict,
                     on_first=lambda: None) -> str:  # fmt: skip
    """Stream one chat completion; fill ``res`` (wall seconds); the answer text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
    t0 = time.monotonic()
    pieces: list[str] = []
    try:
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as r:  # fmt: skip
            res["status"] = r.status_code
            if r.status_code != 200:
                res["error"] = (await r.aread()).decode("utf-8", "replace")[:300]
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                res["id"] = res.get("id") or chunk.get("id")
                if chunk.get("usage"):
                    res["completion_tokens"] = chunk["usage"].get("completion_tokens", 0)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res["cached_tokens"] = details.get("cached_tokens", 0)
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if "ttft_wall" not in res:
                            res["ttft_wall"] = time.monotonic() - t0
                            on_first()
                        pieces.append(text)
                    if choice.get("finish_reason"):
                        res["finish_reason"] = choice["finish_reason"]
                    if "error" in chunk:
                        res["error"] = str(chunk["error"])[:300]
        res["completed"] = bool(res.get("finish_reason")) and res.get("completion_tokens", 0) > 0
    except asyncio.CancelledError:
        res["cut"] = True
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a measured outcome
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        res["e2e_wall"] = time.monotonic() - t0
    return "".join(pieces)
