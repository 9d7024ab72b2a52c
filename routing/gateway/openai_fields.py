"""Which OpenAI request fields the gateway honours, which it may ignore, and which it refuses.

Every top-level field of a /v1/chat/completions or /v1/completions body falls in one group:

- **honoured**: parsed and acted on (model, messages / prompt, max_tokens, temperature, ...,
  ``logprobs`` / ``top_logprobs``);
- **ignored**: harmless to drop, since nothing about the answer depends on them (``user``,
  ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``);
- **refused unless at their default**: what the engine cannot do (tools and function calling,
  structured output, logit bias, audio, predicted outputs, penalties, ``best_of`` > 1,
  ``echo``, ``suffix``, reasoning options). Sent with a value other than the field's neutral
  one (null, false, an empty list or object, 0, ``"none"``, ``{"type": "text"}``) they get a
  400 naming the field instead of an answer that silently ignores them;
- anything else is an **unrecognized** field: a 400 naming it, as OpenAI answers.
"""

from __future__ import annotations

from typing import Any

from routing.gateway.errors import GatewayError, bad_request

COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "logprobs",
}
HONOURED = {
    "chat.completions": COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
    "completions": COMMON | {"prompt"},
}
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}


def _none_or(*neutral: Any):
    def ok(value: Any) -> bool:
        return value is None or any(value == n and type(value) is type(n) for n in neutral)

    return ok


# field -> whether its value is neutral (the engine behaves as if it were absent).
REFUSED = {
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "parallel_tool_calls": _none_or(),
    "response_format": _none_or({"type": "text"}),
    "logit_bias": _none_or({}),
    "audio": _none_or(),
    "modalities": _none_or(["text"]),
    "prediction": _none_or(),
    "presence_penalty": _none_or(0, 0.0),
    "frequency_penalty": _none_or(0, 0.0),
    "reasoning_effort": _none_or(),
    "verbosity": _none_or(),
    "web_search_options": _none_or(),
    "best_of": _none_or(1),
    "echo": _none_or(False),
    "suffix": _none_or(""),
}

MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # and for the legacy completions' logprobs


def unsupported(name: str, value: Any) -> GatewayError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return GatewayError(
        400,
        f"'{name}' is not supported by this gateway (got {shown}): the engine cannot honour "
        f"it, so it is refused rather than ignored.",
        param=name,
        code="unsupported_parameter",
    )


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """400 naming the first field the gateway cannot honour or does not know."""
    honoured = HONOURED[endpoint]
    for name, value in body.items():
        if name in honoured or name in IGNORED:
            continue
        neutral = REFUSED.get(name)
        if neutral is None:
            raise GatewayError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )
        if not neutral(value):
            raise unsupported(name, value)


def _count(value: Any, name: str, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise bad_request(f"'{name}' must be an integer between 0 and {hi}, got {value!r}.", name)
    return value


def logprobs_count(body: dict[str, Any], endpoint: str) -> int | None:
    """How many alternatives per token the request asks for: None = no logprobs at all,
    0 = only the sampled token's, k = the sampled token's plus the top k."""
    if endpoint == "chat.completions":
        wanted = body.get("logprobs")
        top = body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise bad_request("'logprobs' must be a boolean.", "logprobs")
        if top is not None:
            top = _count(top, "top_logprobs", MAX_CHAT_TOP_LOGPROBS)
            if not wanted:
                raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    return None if value is None else _count(value, "logprobs", MAX_COMPLETION_LOGPROBS)
