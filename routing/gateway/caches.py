"""The gateway's hot-path caches: the API key -> tenant lookup (with the tenant's limits) and
the served model, read from the database once and kept until they change, instead of on every
request.

A save or delete of a key, a tenant or a model (the API, the admin, ``manage.py``) bumps a
counter in the same transaction; every gateway process reads the counters at most every half
second (routing/caching.py), so a revoked key, a deactivated tenant, a changed limit or a
removed model takes effect everywhere within about half a second of its commit, and in the
saving process at once. A change made without a save (a queryset update, SQL) lands within 30 s.
Unknown keys are cached too (as None), so a client retrying a bad key does not reach the
database each time; the cache is bounded (least recently used out first)."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save

from billing.models import ApiKey, Tenant
from fleet.models import ServedModel
from pdd import tokens
from routing.caching import CHECK_EVERY_S, shared_cache, versions

__all__ = ["CHECK_EVERY_S", "api_keys", "secret_key", "served_models"]


def secret_key(raw: str) -> str:
    """What a raw API key is cached under: its digest, so the cache never holds the secret."""
    return tokens.digest(raw)


# The gateway's caches (routing/gateway/views.py reads them): kept until the data changes.
api_keys = shared_cache("auth")  # key digest -> ApiKey (with its tenant) or None
served_models = shared_cache("models")  # model name -> ServedModel or None


def _bump_auth(**_: object) -> None:
    versions.bump("auth")


def _bump_models(**_: object) -> None:
    versions.bump("models")


def connect_invalidation() -> None:
    """Bump the counters when a key, a tenant or a model is saved or deleted (routing's
    AppConfig.ready); every process sees it within CHECK_EVERY_S, this one at once."""
    pairs = ((ApiKey, _bump_auth), (Tenant, _bump_auth), (ServedModel, _bump_models))
    for model, receiver in pairs:
        uid = f"gateway-cache-{model.__name__}"
        post_save.connect(receiver, sender=model, dispatch_uid=uid)
        post_delete.connect(receiver, sender=model, dispatch_uid=uid)
