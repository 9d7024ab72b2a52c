"""Step 1 of a request's path: admission. Who asks (the API key, from the cache), what (the
parsed OpenAI request, its token ids, within the model's context) and whether the tenant may
(its rate limits). The result is a `Prepared` with the admission fields set; every refusal is
a GatewayError in OpenAI's shape."""

from __future__ import annotations

import time

from django.conf import settings
from django.http import HttpRequest

from billing.models import ApiKey
from billing.ratelimit import RateLimiter
from billing.services import api_key_authenticate
from fleet.models import ServedModel
from routing.gateway import parsing
from routing.gateway.caches import api_keys, secret_key, served_models
from routing.gateway.errors import GatewayError, bad_request, rate_limited, unauthorized
from routing.gateway.prepared import Prepared, Refused
from routing.gateway.request_ids import gateway_request_id, mark
from routing.gateway.timing import Stopwatch
from routing.gateway.tokenizers import apply_chat_template, tokenizer_for

_limiter: RateLimiter | None = None


def limiter() -> RateLimiter:
    global _limiter
    if _limiter is None:
        _limiter = RateLimiter(settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:rl")
    return _limiter


def authenticate(request: HttpRequest) -> ApiKey:
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    raw = raw.strip()
    key = api_keys.get(secret_key(raw), lambda: api_key_authenticate(raw))
    if key is None:
        raise unauthorized("Invalid, revoked or inactive API key.")
    return key


def served_model(name: str) -> ServedModel:
    model = served_models.get(name, lambda: ServedModel.objects.filter(name=name).first())
    if model is None:
        raise GatewayError(
            404, f"The model '{name}' does not exist.", param="model", code="model_not_found"
        )
    return model


def admit(request: HttpRequest, kind: str, watch: Stopwatch) -> Prepared:
    """Authenticate, parse, tokenize, check the context (reads only: ``identify``), then count
    the request against the tenant's limits (``check_limits``), the one side effect, last: a
    read that needs the database on the event loop raises before anything was counted."""
    p = identify(request, kind, watch)
    check_limits(p)
    return p


def identify(request: HttpRequest, kind: str, watch: Stopwatch) -> Prepared:
    """Everything admission reads (the key, the parsed request, its token ids, the context),
    with no side effect: the tenant's limits are ``check_limits``'s."""
    received_at = time.monotonic()
    watch.lap("queue")  # the hop onto a gateway worker thread
    key = authenticate(request)
    # Who asked, for the error counters should a later step refuse the request.
    mark(request, baton_tenant=key.tenant.name)
    watch.lap("auth")
    body = parsing.parse_json(request.body)
    greq = (
        parsing.parse_chat(body, apply_chat_template)
        if kind == "chat.completions"
        else parsing.parse_completion(body)
    )
    watch.lap("parse")
    mark(request, baton_model=greq.model)
    model = served_model(greq.model)
    tokenizer = tokenizer_for(name=model.name, source=model.source, tokenizer=model.tokenizer)
    prompt_ids = tokenizer.encode(greq.prompt_text)
    watch.lap("tokenize")
    total = len(prompt_ids) + greq.max_tokens
    if total > model.max_context_tokens:
        raise bad_request(
            f"This model's maximum context length is {model.max_context_tokens} tokens; the "
            f"prompt ({len(prompt_ids)}) plus max_tokens ({greq.max_tokens}) is {total}.",
            "max_tokens",
        )
    return Prepared(
        key=key,
        greq=greq,
        model=model,
        tokenizer=tokenizer,
        prompt_ids=prompt_ids,
        request_id=gateway_request_id(request, kind),
        client_request_id=getattr(request, "baton_client_request_id", ""),
        kind=kind,
        received_at=received_at,
        watch=watch,
    )


def check_limits(p: Prepared) -> None:
    """The tenant's requests and tokens per minute: this request counts against them. Over
    either: Refused (the composer records the refusal)."""
    tenant = p.key.tenant
    verdict = limiter().check(
        tenant=tenant.name,
        rpm=tenant.requests_per_minute,
        tpm=tenant.tokens_per_minute,
        tokens=len(p.prompt_ids) + p.greq.max_tokens,
    )
    if not verdict.allowed:
        per_minute = "requests" if verdict.limit == "requests" else "tokens"
        raise Refused(
            p,
            rate_limited(verdict.limit, verdict.retry_after_s),
            f"rate limited: the tenant's {per_minute} per minute",
        )
    if p.watch is not None:
        p.watch.lap("limit")
