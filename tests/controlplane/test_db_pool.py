"""PostgreSQL connections come from a bounded pool per process: a burst of threads wanting
the database queues for the pool's connections and every one of them is served, with never
more connections open than the pool allows."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.conf import settings
from django.db import connection, connections, transaction

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _backends(dsn: str, dbname: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as probe:
        return probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [dbname],
        ).fetchone()[0]


def test_a_burst_queues_for_the_pools_connections():
    pool = connection.pool
    if pool is None:
        pytest.skip("BATON_DB_POOL_MAX=0: no pool")
    assert pool.max_size == settings.BATON_DB_POOL_MAX
    params = connection.get_connection_params()
    params.pop("pool", None)
    dbname = params["dbname"]
    dsn = psycopg.conninfo.make_conninfo(
        **{k: v for k, v in params.items() if k in {"dbname", "user", "password", "host", "port"}}
    )
    burst = 3 * pool.max_size
    served: list[int] = []
    peak = [0]
    done = threading.Event()

    def one_request(k: int) -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(0.1), %s", [k])
                served.append(cursor.fetchone()[1])
        finally:
            connections.close_all()  # the end of a request: the connection goes back

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _backends(dsn, dbname))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one_request, args=(k,)) for k in range(burst)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert sorted(served) == list(range(burst))
    # This test's own connection and the burst's, all from the pool.
    assert 1 < peak[0] <= pool.max_size
    assert pool.get_stats().get("requests_queued", 0) > 0  # some waited for a connection
