"""Tenant API keys (hashed, shown once) and the idempotent usage ledger."""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from billing.models import ApiKey, Tenant, UsageEntry


def api_key_create(*, tenant: Tenant, name: str = "") -> tuple[ApiKey, str]:
    """A new key for the tenant, returned with its raw value, which is not recoverable later."""
    key = ApiKey(tenant=tenant, name=name)
    raw = key.new_secret()
    key.save(force_insert=True)
    return key, raw


def api_key_authenticate(raw: str) -> ApiKey | None:
    """The active key for a raw value, or None (unknown, malformed, revoked, inactive tenant)."""
    key = ApiKey.find(raw, ApiKey.objects.select_related("tenant"))
    if key is None or not key.is_active:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at > timedelta(minutes=1):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def api_key_revoke(*, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
    return key


# What a request's record says that makes it billed: answered (``ok``), ended by its client
# (``cancelled``) or by a gateway that died under it (``interrupted``), for the tokens it got.
# A request refused (``rejected``: no healthy path, no room, the tenant's rate limit) or failed
# on the agents (``error``) is not billed.
BILLED_STATUSES = frozenset({"ok", "cancelled", "interrupted"})


def is_billed(status: str, prompt_tokens: int) -> bool:
    """Whether a request that ended with ``status`` gets a usage line (docs/billing.md)."""
    return status in BILLED_STATUSES and prompt_tokens > 0


def usage_line(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    status: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
) -> dict | None:
    """What a finished request is billed: ``usage_record``'s keyword arguments for its line
    (the key's tenant, the model, the tokens), or None when it is not billed (``is_billed``).
    The gateway's records call this for every request they record (routing/gateway/records.py)."""
    if not is_billed(status, prompt_tokens):
        return None
    return {
        "request_id": request_id,
        "tenant": api_key.tenant,
        "api_key": api_key,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens,
    }


def usage_record(
    *,
    request_id: str,
    tenant: Tenant,
    api_key: ApiKey | None,
    model: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
) -> tuple[UsageEntry, bool]:
    """Write the ledger line for a request once; a second call returns the first line."""
    existing = UsageEntry.objects.filter(request_id=request_id).first()
    if existing is not None:
        return existing, False
    entry = _usage_entry(
        request_id=request_id,
        tenant=tenant,
        api_key=api_key,
        model=model,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
    )
    try:
        with transaction.atomic():
            entry.save(force_insert=True)
    except IntegrityError:  # a concurrent writer won the race: keep its line
        return UsageEntry.objects.get(request_id=request_id), False
    return entry, True


def usage_records(lines: list[dict]) -> int:
    """``usage_record`` for many requests in two statements (the gateway's record writer writes
    a batch's lines at once): each ``lines`` item holds ``usage_record``'s keyword arguments;
    a request id that has a line already, or comes twice, is written once. Returns how many
    lines were written. A concurrent writer's line makes the insert fail with IntegrityError
    (nothing written): the caller writes those lines one by one with ``usage_record``."""
    ids = [line["request_id"] for line in lines]
    written = set(
        UsageEntry.objects.filter(request_id__in=ids)
        .order_by()
        .values_list("request_id", flat=True)
    )
    new: list[UsageEntry] = []
    for line in lines:
        if line["request_id"] in written:
            continue
        written.add(line["request_id"])
        new.append(_usage_entry(**line))
    UsageEntry.objects.bulk_create(new)
    return len(new)


def _usage_entry(*, cached_tokens: int, prompt_tokens: int, **fields) -> UsageEntry:
    """A ledger line, not saved yet; its cached tokens never exceed its prompt tokens."""
    return UsageEntry(
        **fields, prompt_tokens=prompt_tokens, cached_tokens=min(cached_tokens, prompt_tokens)
    )
