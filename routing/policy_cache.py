"""The policy settings a gateway process uses, reloaded when the stored version moves.

The version is read at most every `check_every_s` (default 0.5 s), so an operator's change
through /api/v1/routing-policy/ reaches every gateway process within a second, no restart.
"""

from __future__ import annotations

import threading
import time

from pdd.policy import PolicySettings
from routing import services
from routing.models import RoutingPolicyConfig


class PolicyCache:
    def __init__(self, check_every_s: float = 0.5) -> None:
        self.check_every_s = check_every_s
        self._lock = threading.Lock()
        self._settings: PolicySettings | None = None
        self._version = 0
        self._checked_at = 0.0
        self._background = False

    def current(self) -> tuple[PolicySettings, int]:
        now = time.monotonic()
        with self._lock:
            # A background refresher (``refresh``) reads every check_every_s: a request reads
            # only if it fell two periods behind.
            period = self.check_every_s * (2 if self._background else 1)
            if self._settings is not None and now - self._checked_at < period:
                return self._settings, self._version
        return self._load(now)

    def refresh(self) -> None:
        """Read the version now (the cache-version refresher's thread calls this)."""
        self._load(time.monotonic())
        with self._lock:
            self._background = True

    def _load(self, now: float) -> tuple[PolicySettings, int]:
        version = RoutingPolicyConfig.objects.filter(pk=1).values_list("version", flat=True).first()
        with self._lock:
            self._checked_at = now
            if self._settings is None or version != self._version:
                config = services.policy_current()
                self._settings = services.policy_settings(config)
                self._version = config.version
            return self._settings, self._version

    def clear(self) -> None:
        with self._lock:
            self._settings, self._version, self._checked_at = None, 0, 0.0
            self._background = False
