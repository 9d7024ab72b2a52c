"""Billing benchmark: rate a month of 1,000,000 usage entries into statements on PostgreSQL.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres .venv/bin/python -m bench.billing

DATABASE_URL names the server (and a database to connect to for CREATE/DROP); the bench
creates its own database ``baton_bench_billing_<pid>``, migrates it, loads the scenario with
COPY, and drops it at the end. The scenario is fixed (below) and was fixed before the first run:

- March 2026 (UTC), 1,000,000 entries, created_at uniform over the month (seeded RNG);
- 20 tenants with Zipf-like weights (tenant i gets weight 1/(i+1): the largest about 28%);
- 4 served models (weights 0.4, 0.3, 0.2, 0.1), each with a list price that changes on the
  16th (a mid-month price change: two lines per model), and contract prices for tenants 0-2
  on two models (one of them starting on the 10th);
- tokens: prompt 50-8,000, cached 0-prompt/2 on half the entries, completion 1-2,000.

Timed, 3 runs, each from a clean state (no statements, so no entry is billed yet):

- ``statements``: ``billing.statements.rate_pending`` for the month: create the 20 March
  statements and build their lines (rating all of them in one grouped query; membership is
  by tenant and created_at range, no row of the ledger is written). The goal: under 5 s for
  the month's statements of all tenants.
- ``refresh``: ``refresh_open``: check every open statement and re-rate the changed ones
  (none changed: it is the every-5-minutes cost with no new usage).
- ``refresh_forced``: ``refresh_open(force=True)``: re-rate all 20 (what ``refresh`` did
  before statements were re-rated only when changed).
- ``rate_month``: ``billing.rating.rate`` over the whole month's entries (one query).
- ``largest``: rebuild the largest tenant's statement alone.
- ``close``: ``close_statements`` on April 1st: watermark, final lines, close all 20.

Up to commit 108036f (the "before" figures in REPORT.md) the bench timed assigning each
entry to its statement with an UPDATE per tenant; the scenario is unchanged.

Raw output: var/bench-billing/<UTC time>.json.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = 1_000_000
TENANTS = 20
MODELS = [("bench-a", 0.4), ("bench-b", 0.3), ("bench-c", 0.2), ("bench-d", 0.1)]
MONTH = datetime(2026, 3, 1, tzinfo=UTC)
MONTH_END = datetime(2026, 4, 1, tzinfo=UTC)
MID = datetime(2026, 3, 16, tzinfo=UTC)
NOW = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)  # the month still open while it is rated
RUNS = 3
SEED = 20260301
GOAL_S = 5.0


def _server_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    if not url.startswith(("postgres://", "postgresql://")):
        sys.exit("DATABASE_URL must point at PostgreSQL")
    return url


def _with_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def _admin(url: str):
    import psycopg

    return psycopg.connect(url.replace("postgresql://", "postgres://", 1), autocommit=True)


def _setup_django(db_url: str) -> None:
    os.environ["DATABASE_URL"] = db_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("BATON_EMBEDDED_BEAT", "false")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings

    settings.DATABASES["default"]["ATOMIC_REQUESTS"] = False


def _seed_catalogue() -> list[int]:
    from billing import pricing
    from billing.models import ModelPrice, Tenant
    from fleet.models import ServedModel

    tenants = [Tenant.objects.create(name=f"tenant-{i:02d}") for i in range(TENANTS)]
    models = {
        name: ServedModel.objects.create(
            name=name, source="baton-tiny", num_layers=4, kv_bytes_per_token=2048
        )
        for name, _ in MODELS
    }

    def price(model, inp, tenant=None, start=MONTH - timedelta(days=60), end=None):
        pricing.model_price_save(
            price=ModelPrice(
                served_model=model,
                tenant=tenant,
                input_per_mtok=Decimal(inp),
                cached_input_per_mtok=Decimal(inp) / 10,
                output_per_mtok=Decimal(inp) * 3,
                currency="USD",
                effective_from=start,
                effective_to=end,
            )
        )

    for k, (name, _) in enumerate(MODELS):
        base = Decimal("0.50") * (k + 1)
        price(models[name], base, end=MID)
        price(models[name], base * Decimal("1.2"), start=MID)
    for t in tenants[:3]:
        price(models["bench-a"], "0.40", tenant=t)
        price(models["bench-b"], "0.80", tenant=t, start=datetime(2026, 3, 10, tzinfo=UTC))
    return [t.pk for t in tenants]


def _load(tenant_ids: list[int]) -> float:
    from django.db import connection

    rng = random.Random(SEED)
    weights = [1 / (i + 1) for i in range(TENANTS)]
    span_us = int((MONTH_END - MONTH).total_seconds() * 1_000_000)
    names = [m for m, _ in MODELS]
    model_w = [w for _, w in MODELS]
    tenants = rng.choices(tenant_ids, weights=weights, k=ENTRIES)
    models = rng.choices(names, weights=model_w, k=ENTRIES)
    t0 = time.perf_counter()
    with connection.cursor() as cur:
        raw = cur.connection
        with (
            raw.cursor() as c,
            c.copy(
                "COPY billing_usageentry (request_id, tenant_id, model, prompt_tokens, "
                "cached_tokens, completion_tokens, created_at) FROM STDIN"
            ) as copy,
        ):
            for i in range(ENTRIES):
                prompt = rng.randint(50, 8000)
                cached = rng.randint(0, prompt // 2) if rng.random() < 0.5 else 0
                when = MONTH + timedelta(microseconds=rng.randrange(span_us))
                copy.write_row(
                    (
                        f"bench-{i:07d}",
                        tenants[i],
                        models[i],
                        prompt,
                        cached,
                        rng.randint(1, 2000),
                        when,
                    )
                )
        cur.execute("ANALYZE")
    return time.perf_counter() - t0


def _reset() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("DELETE FROM billing_statementline")
        cur.execute("DELETE FROM billing_statement")
        cur.execute("VACUUM ANALYZE billing_usageentry")


def _timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _one_run() -> dict:
    from billing import statements
    from billing.models import Statement, StatementStatus, UsageEntry
    from billing.rating import rate

    _reset()
    t_statements, assigned = _timed(lambda: statements.rate_pending(now=NOW))
    assert assigned == ENTRIES, assigned
    t_refresh, refreshed = _timed(lambda: statements.refresh_open(now=NOW))
    t_forced, forced = _timed(lambda: statements.refresh_open(now=NOW, force=True))
    month = UsageEntry.objects.filter(created_at__gte=MONTH, created_at__lt=MONTH_END)
    t_rate, lines = _timed(lambda: rate(month))
    largest = Statement.objects.order_by("-entry_count").first()
    version = statements.price_book_version()
    t_largest, _ = _timed(lambda: statements.rebuild_statements([largest.pk], NOW, version))
    largest.refresh_from_db()
    assert largest.entry_count == statements.entries_of(largest).count()
    totals = statements.totals(list(largest.lines.all()))
    t_close, closed = _timed(
        lambda: statements.close_statements(now=MONTH_END + timedelta(minutes=5))
    )
    assert len(closed) == TENANTS, closed
    assert not Statement.objects.filter(status=StatementStatus.OPEN).exists()
    return {
        "statements_s": t_statements,
        "refresh_s": t_refresh,
        "refresh_forced_s": t_forced,
        "rate_month_s": t_rate,
        "largest_s": t_largest,
        "close_s": t_close,
        "statements": Statement.objects.count(),
        "refreshed": refreshed,
        "refreshed_forced": forced,
        "month_lines": len(lines),
        "lines": sum(st.lines.count() for st in Statement.objects.all()),
        "largest_entries": largest.entry_count,
        "largest_lines": largest.lines.count(),
        "largest_total": [{"currency": t["currency"], "amount": str(t["amount"])} for t in totals],
    }


def main(argv: list[str] | None = None) -> int:
    server = _server_url()
    name = f"baton_bench_billing_{os.getpid()}"
    started = time.perf_counter()
    with _admin(server) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    out: dict = {
        "command": "python -m bench.billing",
        "started_at": datetime.now(UTC).isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "scenario": {
            "entries": ENTRIES,
            "tenants": TENANTS,
            "models": MODELS,
            "month": "2026-03",
            "price_change": MID.isoformat(),
            "seed": SEED,
        },
        "runs": [],
    }
    try:
        _setup_django(_with_db(server, name))
        from django.core.management import call_command
        from django.db import connection

        t0 = time.perf_counter()
        call_command("migrate", verbosity=0)
        out["migrate_s"] = time.perf_counter() - t0
        with connection.cursor() as cur:
            cur.execute("SELECT version()")
            out["machine"]["postgres"] = cur.fetchone()[0]
        tenant_ids = _seed_catalogue()
        out["load_s"] = _load(tenant_ids)
        print(f"loaded {ENTRIES:,} entries in {out['load_s']:.1f} s", flush=True)
        for i in range(RUNS):
            run = _one_run()
            out["runs"].append(run)
            print(
                f"run {i + 1}: statements {run['statements_s']:.2f} s "
                f"({ENTRIES / run['statements_s']:,.0f} entries/s), refresh "
                f"{run['refresh_s']:.2f} s (forced {run['refresh_forced_s']:.2f} s), rate(month) "
                f"{run['rate_month_s']:.2f} s, largest tenant {run['largest_s']:.2f} s "
                f"({run['largest_entries']:,} entries), close {run['close_s']:.2f} s",
                flush=True,
            )
        med = {
            k: statistics.median(r[k] for r in out["runs"])
            for k in (
                "statements_s",
                "refresh_s",
                "refresh_forced_s",
                "rate_month_s",
                "largest_s",
                "close_s",
            )
        }
        out["median"] = med
        out["entries_rated_per_s"] = ENTRIES / med["statements_s"]
        out["goal"] = {
            "statements_under_s": GOAL_S,
            "met": med["statements_s"] < GOAL_S,
        }
        print(
            f"median: statements {med['statements_s']:.2f} s = "
            f"{out['entries_rated_per_s']:,.0f} entries rated/s; refresh {med['refresh_s']:.2f} s;"
            f" rate(month) {med['rate_month_s']:.2f} s; largest {med['largest_s']:.2f} s; goal "
            f"(< {GOAL_S} s) {'met' if out['goal']['met'] else 'missed'}",
            flush=True,
        )
    finally:
        from django.db import connections

        connections.close_all()
        with _admin(server) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        out["total_s"] = time.perf_counter() - started
        var = ROOT / "var" / "bench-billing"
        var.mkdir(parents=True, exist_ok=True)
        path = var / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
        path.write_text(json.dumps(out, indent=2, default=str))
        print(f"raw output: {path.relative_to(ROOT)} (total {out['total_s']:.0f} s)")
    return 0
