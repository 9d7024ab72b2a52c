"""In-process caches for the gateway's hot path, each entry trusted for at most `max_age_s`.

The API key -> tenant lookup (with the tenant's limits) and the served model are read from the
database at most every half second per key or model and process, instead of on every request:
a revoked key, a deactivated tenant, a changed limit or a removed model takes effect in every
gateway process within `max_age_s`, with no invalidation messages to lose. Unknown keys are
cached too (as None), so a client retrying a bad key does not reach the database each time;
the cache is bounded (least recently used out first). A change saved through this process (a
revocation through the API, an operator's edit) also empties the caches at once, by signal."""

from __future__ import annotations

import hashlib

from django.db.models.signals import post_delete, post_save

from billing.models import ApiKey, Tenant
from fleet.models import ServedModel
from routing.caching import MAX_AGE_S, TtlCache

__all__ = ["MAX_AGE_S", "TtlCache", "api_keys", "served_models", "secret_key"]


def secret_key(raw: str) -> str:
    """What a raw API key is cached under: its digest, so the cache never holds the secret."""
    return hashlib.sha256(raw.encode()).hexdigest()


# The gateway's caches (routing/gateway/views.py reads them).
api_keys: TtlCache = TtlCache()  # key digest -> ApiKey (with its tenant) or None
served_models: TtlCache = TtlCache()  # model name -> ServedModel or None


def forget_keys(**_: object) -> None:
    api_keys.clear()


def forget_models(**_: object) -> None:
    served_models.clear()


def connect_invalidation() -> None:
    """Empty the caches when this process saves or deletes what they hold (routing's
    AppConfig.ready); other processes see the change within MAX_AGE_S."""
    pairs = ((ApiKey, forget_keys), (Tenant, forget_keys), (ServedModel, forget_models))
    for model, receiver in pairs:
        uid = f"gateway-cache-{model.__name__}"
        post_save.connect(receiver, sender=model, dispatch_uid=uid)
        post_delete.connect(receiver, sender=model, dispatch_uid=uid)
