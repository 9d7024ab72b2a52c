"""The routing policy's version is read by the cache refresher's thread, not by requests, in a
serving process; a change still lands within a couple of periods."""

from __future__ import annotations

import time

import pytest

from routing.caching import CacheVersions
from routing.models import RoutingPolicyConfig
from routing.policy_cache import PolicyCache

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_refresher_reads_the_policy_so_requests_do_not(django_assert_num_queries):
    policies = PolicyCache(check_every_s=0.5)
    versions = CacheVersions(check_every_s=0.5)
    versions.on_refresh(policies.refresh)
    _, version = policies.current()  # loaded once (as the first request would)
    stop = versions.start_refresher()
    try:
        deadline = time.monotonic() + 10
        while not policies._background and time.monotonic() < deadline:
            time.sleep(0.01)
        with django_assert_num_queries(0):
            for _ in range(20):
                assert policies.current()[1] == version
                time.sleep(0.005)
        RoutingPolicyConfig.objects.filter(pk=1).update(version=version + 7)
        while policies._version != version + 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert policies._version == version + 7
    finally:
        stop.set()
