"""TEST / DEMO TOOL: write synthetic request records and aggregate them.

The records are made up (see frontend/synthetic.py); they exist to bring the dashboard to life
in browser tests and demos before real traffic flows. Never quote figures from them.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand

from frontend.synthetic import synthetic_records_create
from frontend.telemetry import get_aggregator, observe_many


class Command(BaseCommand):
    help = "TEST/DEMO ONLY: write N synthetic RequestRecords and feed them to telemetry."

    def add_arguments(self, parser):
        parser.add_argument("--count", type=int, default=100)
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--model", default=None, help="Model name (default: the fleet's).")

    def handle(self, *args, count: int, seed: int | None, model: str | None, **options):
        records = synthetic_records_create(count=count, seed=seed, model=model)
        observe_many(records)
        get_aggregator().store.flush()
        self.stdout.write(
            f"wrote {len(records)} synthetic request records (test/demo data) and observed them"
        )
