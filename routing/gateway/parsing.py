"""Turn OpenAI chat / completions request bodies into one validated GatewayRequest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from base import jsonsafety
from pdd.checks import is_number
from routing.gateway.errors import bad_request
from routing.gateway.openai_fields import check_fields, logprobs_count

DEFAULT_COMPLETIONS_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256


@dataclass(slots=True)
class GatewayRequest:
    endpoint: str  # "chat.completions" or "completions"
    model: str
    prompt_text: str
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool
    include_usage: bool
    seed: int | None
    stop: list[str] = field(default_factory=list)
    user: str = ""
    # Alternatives per token to return with logprobs: None = none asked, 0 = the sampled
    # token's logprob only, k = it plus the top k (openai_fields.logprobs_count).
    logprobs: int | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = jsonsafety.loads(raw or b"{}")
    except jsonsafety.UnsafeJSON as exc:
        raise bad_request(exc.message, exc.path or None) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not is_number(value):
        raise bad_request(f"'{name}' must be a number.", name)
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}.", name)
    return float(value)


def _max_tokens(body: dict, default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_request(f"'{name}' must be a positive integer.", name)
        return value
    return default


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return stop
    raise bad_request("'stop' must be a string or a list of up to 4 strings.", "stop")


def _common(body: dict, endpoint: str, prompt_text: str, default_max: int) -> GatewayRequest:
    check_fields(body, endpoint)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required.", "model")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad_request("Only n=1 is supported.", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer.", "seed")
    return GatewayRequest(
        endpoint=endpoint,
        model=model,
        prompt_text=prompt_text,
        max_tokens=_max_tokens(body, default_max),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        seed=seed,
        stop=_stop(body),
        user=str(body.get("user", ""))[:128],
        logprobs=logprobs_count(body, endpoint),
    )


def parse_chat(body: dict[str, Any], render_messages) -> GatewayRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'.", "messages")
    try:
        prompt_text = render_messages(messages)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"'messages' is not valid: {exc}", "messages") from exc
    return _common(body, "chat.completions", prompt_text, DEFAULT_CHAT_MAX_TOKENS)


def parse_completion(body: dict[str, Any]) -> GatewayRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string.", "prompt")
    return _common(body, "completions", prompt, DEFAULT_COMPLETIONS_MAX_TOKENS)
