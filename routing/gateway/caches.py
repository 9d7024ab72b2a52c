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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from django.db.models.signals import post_delete, post_save

from billing.models import ApiKey, Tenant
from fleet.models import ServedModel

V = TypeVar("V")

MAX_AGE_S = 0.5


class TtlCache(Generic[V]):
    def __init__(self, max_age_s: float = MAX_AGE_S, capacity: int = 10_000) -> None:
        self.max_age_s = max_age_s
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        """The cached value for `key` if younger than max_age_s, else `load()` (stored)."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and now - hit[0] < self.max_age_s:
                self._entries.move_to_end(key)
                return hit[1]
        value = load()
        with self._lock:
            self._entries[key] = (now, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


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
