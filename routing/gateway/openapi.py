"""The OpenAI-compatible gateway (/v1/chat/completions, /v1/completions, /v1/models) in the
OpenAPI schema, under the ``openai`` tag.

The gateway's views are plain async Django views (no DRF: the hot path pays for none of it),
so drf-spectacular does not see them; ``add_gateway_paths``, a postprocessing hook
(SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]), adds their operations and components as
written here. The request schemas say exactly what the gateway accepts (openai_fields.py): the
fields it honours, the harmless ones it ignores, and the ones it refuses unless at their
neutral value (documented with that value only); any other field is refused.
"""

from __future__ import annotations

from typing import Any

from billing.tenant_openapi import SECURITY_SCHEME, SECURITY_SCHEME_NAME
from pdd import openai_errors
from routing.gateway.openai_fields import (
    IGNORED,
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
)

TAG = "openai"
REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


_ANY_OBJECT = {"type": "object", "additionalProperties": {}}
_STOP = _nullable(
    {
        "description": "Up to 4 strings; the text ends before the first one generated.",
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        ],
    }
)

# Accepted and acted on by both endpoints.
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "A served model (GET /v1/models)."},
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2, "default": 1}),
    "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "default": 1}),
    "n": _nullable({"type": "integer", "enum": [1], "description": "Only 1 (else a 400)."}),
    "stream": {"type": "boolean", "default": False},
    "stream_options": _nullable(
        {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}
    ),
    "stop": _STOP,
    "seed": _nullable({"type": "integer"}),
}
# Accepted and ignored: nothing about the answer depends on them.
_IGNORED: dict[str, Any] = {
    name: {"description": "Accepted and ignored."} for name in sorted(IGNORED)
}


def _neutral(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return _nullable(
        {**schema, "description": f"Not supported: only {description} (or null) is accepted."}
    )


def _null_only(type_: str) -> dict[str, Any]:
    return {
        "type": type_,
        "nullable": True,
        "enum": [None],
        "description": "Not supported: only null is accepted.",
    }


# Refused (400 unsupported_parameter naming the field) unless at their neutral value.
_REFUSED_CHAT: dict[str, Any] = {
    "tools": _neutral("an empty list", {"type": "array", "items": {}, "maxItems": 0}),
    "tool_choice": _neutral('"none"', {"type": "string", "enum": ["none"]}),
    "functions": _neutral("an empty list", {"type": "array", "items": {}, "maxItems": 0}),
    "function_call": _neutral('"none"', {"type": "string", "enum": ["none"]}),
    "parallel_tool_calls": _null_only("boolean"),
    "response_format": _neutral(
        '{"type": "text"}',
        {
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["text"]}},
            "required": ["type"],
            "additionalProperties": False,
        },
    ),
    "logit_bias": _neutral("an empty object", {"type": "object", "maxProperties": 0}),
    "audio": _null_only("object"),
    "modalities": _neutral(
        '["text"]',
        {"type": "array", "items": {"type": "string", "enum": ["text"]}, "minItems": 1},
    ),
    "prediction": _null_only("object"),
    "presence_penalty": _neutral("0", {"type": "number", "enum": [0]}),
    "frequency_penalty": _neutral("0", {"type": "number", "enum": [0]}),
    "reasoning_effort": _null_only("string"),
    "verbosity": _null_only("string"),
    "web_search_options": _null_only("object"),
}
_REFUSED_COMPLETION: dict[str, Any] = {
    "logit_bias": _REFUSED_CHAT["logit_bias"],
    "presence_penalty": _REFUSED_CHAT["presence_penalty"],
    "frequency_penalty": _REFUSED_CHAT["frequency_penalty"],
    "best_of": _neutral("1", {"type": "integer", "enum": [1]}),
    "echo": _neutral("false", {"type": "boolean", "enum": [False]}),
    "suffix": _neutral('""', {"type": "string", "maxLength": 0}),
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {
                "cached_tokens": {
                    "type": "integer",
                    "description": "Prompt tokens served from a decoder's prefix cache.",
                }
            },
        },
    },
}
_TOKEN_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": _nullable({"type": "number"}),
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    },
}
_LOGPROBS_NOTE = (
    "Log-probabilities of the raw model distribution (log-softmax of the logits, before "
    "temperature and top-p), as vLLM returns by default."
)

COMPONENTS: dict[str, Any] = {
    "OpenAIError": openai_errors.OPENAPI_SCHEMA,
    "OpenAIChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "description": "system, developer, user or assistant."},
            "content": _nullable(
                {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "description": "Text parts: {type: text, text}.",
                            "items": _ANY_OBJECT,
                        },
                    ]
                }
            ),
            "name": {"type": "string"},
        },
    },
    "OpenAIChatCompletionRequest": {
        "type": "object",
        "description": "Any field not listed here is refused (400 unknown_parameter).",
        "required": ["model", "messages"],
        "additionalProperties": False,
        "properties": {
            **_COMMON,
            "messages": {"type": "array", "minItems": 1, "items": _ref("OpenAIChatMessage")},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            "logprobs": _nullable(
                {"type": "boolean", "description": "Return each token's logprob."}
            ),
            "top_logprobs": _nullable(
                {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_CHAT_TOP_LOGPROBS,
                    "description": "Alternatives per token; needs logprobs: true.",
                }
            ),
            **_IGNORED,
            **_REFUSED_CHAT,
        },
    },
    "OpenAICompletionRequest": {
        "type": "object",
        "description": "Any field not listed here is refused (400 unknown_parameter).",
        "required": ["model", "prompt"],
        "additionalProperties": False,
        "properties": {
            **_COMMON,
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "minItems": 1,
                        "maxItems": 1,
                    },
                ]
            },
            "logprobs": _nullable(
                {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_COMPLETION_LOGPROBS,
                    "description": "Alternatives per token (the sampled token is always "
                    "included, so up to logprobs + 1).",
                }
            ),
            **_IGNORED,
            **_REFUSED_COMPLETION,
        },
    },
    "OpenAIChatLogprobs": {
        "type": "object",
        "description": _LOGPROBS_NOTE,
        "properties": {
            "content": {
                "type": "array",
                "items": {
                    "allOf": [_TOKEN_LOGPROB],
                    "type": "object",
                    "properties": {
                        "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB},
                    },
                },
            },
            "refusal": _nullable({"type": "array", "items": {}}),
        },
    },
    "OpenAICompletionLogprobs": {
        "type": "object",
        "description": _LOGPROBS_NOTE,
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": _nullable({"type": "number"})},
            "top_logprobs": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": {"type": "number"}},
            },
            "text_offset": {"type": "array", "items": {"type": "integer"}},
        },
    },
    "OpenAIUsage": _USAGE,
    "OpenAIChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string", "description": "The request's id (X-Request-Id)."},
            "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "properties": {
                                "role": {"type": "string", "enum": ["assistant"]},
                                "content": {"type": "string"},
                            },
                        },
                        "logprobs": _nullable(_ref("OpenAIChatLogprobs")),
                        "finish_reason": {"type": "string", "enum": ["stop", "length"]},
                    },
                },
            },
            "usage": _ref("OpenAIUsage"),
        },
    },
    "OpenAICompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "logprobs": _nullable(_ref("OpenAICompletionLogprobs")),
                        "finish_reason": _nullable({"type": "string", "enum": ["stop", "length"]}),
                    },
                },
            },
            "usage": _nullable(_ref("OpenAIUsage")),
        },
    },
    "OpenAIModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string", "enum": ["model"]},
                        "created": {"type": "integer"},
                        "owned_by": {"type": "string"},
                    },
                },
            },
        },
    },
}

_REQUEST_ID_HEADER = {
    "X-Request-Id": {
        "description": "The client's X-Request-Id when it sent a valid one (1-128 printable "
        "ASCII characters), else the gateway's id for the request.",
        "schema": {"type": "string"},
    }
}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {**_REQUEST_ID_HEADER, **(headers or {})},
        "content": {"application/json": {"schema": _ref("OpenAIError")}},
    }


_ERRORS = {
    "400": _error(
        "Invalid input, or a field the engine cannot honour: error.param names the field."
    ),
    "401": _error("No API key, or an invalid, revoked or inactive one."),
    "404": _error("No such model (error.code model_not_found)."),
    "408": _error("The request body took longer than BATON_BODY_TIMEOUT_S to arrive."),
    "413": _error("The request body is larger than the gateway accepts."),
    "429": _error(
        "The tenant's requests or tokens per minute are used up.",
        {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}},
    ),
    "502": _error("The agents failed the request (not streaming)."),
    "503": _error("No healthy path for the model, or its tokenizer is unavailable."),
}


def _generate(summary: str, request: str, answer: str, stream_note: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": summary.lower().replace(" ", "_"),
            "summary": summary,
            "tags": [TAG],
            "security": [{SECURITY_SCHEME_NAME: []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "The answer; with stream: true, server-sent events "
                    f"(text/event-stream): {stream_note}, then 'data: [DONE]'.",
                    "headers": _REQUEST_ID_HEADER,
                    "content": {
                        "application/json": {"schema": _ref(answer)},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_ERRORS,
            },
        }
    }


PATHS: dict[str, Any] = {
    "/v1/chat/completions": _generate(
        "Create chat completion",
        "OpenAIChatCompletionRequest",
        "OpenAIChatCompletion",
        "'data: {chat.completion.chunk}' lines, each choice's logprobs those of the tokens "
        "whose text its delta carries",
    ),
    "/v1/completions": _generate(
        "Create completion",
        "OpenAICompletionRequest",
        "OpenAICompletion",
        "'data: {text_completion}' lines",
    ),
    "/v1/models": {
        "get": {
            "operationId": "list_models",
            "summary": "List models",
            "tags": [TAG],
            "security": [{SECURITY_SCHEME_NAME: []}],
            "responses": {
                "200": {
                    "description": "The served models.",
                    "headers": _REQUEST_ID_HEADER,
                    "content": {"application/json": {"schema": _ref("OpenAIModelList")}},
                },
                "401": _ERRORS["401"],
            },
        }
    },
}


def add_gateway_paths(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the gateway's operations and their components."""
    result.setdefault("paths", {}).update(PATHS)
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update(COMPONENTS)
    components.setdefault("securitySchemes", {})[SECURITY_SCHEME_NAME] = SECURITY_SCHEME
    return result
