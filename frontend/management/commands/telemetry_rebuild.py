"""Rebuild the telemetry aggregation state from stored request records."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from frontend.telemetry import rebuild


class Command(BaseCommand):
    help = (
        "Replay the last day of RequestRecord rows into the aggregation state (Redis when "
        "REDIS_URL is set; in-process state rebuilds itself on first use)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--hours", type=float, default=24.0, help="How far back to replay.")
        parser.add_argument("--max-rows", type=int, default=None, help="Newest rows at most.")
        parser.add_argument(
            "--keep", action="store_true", help="Add to the current state instead of clearing it."
        )

    def handle(self, *args, hours: float, max_rows: int | None, keep: bool, **options):
        n = rebuild(hours=hours, max_rows=max_rows, clear=not keep)
        self.stdout.write(f"replayed {n} request records from the last {hours:g} h")
