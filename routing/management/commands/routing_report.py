"""The request log's routing figures: requests relayed although MD held their prefix."""

from __future__ import annotations

import json
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from routing.analysis import RELAYED_DESPITE_CACHE_THRESHOLD, cache_estimate_summary
from routing.models import RequestRecord


class Command(BaseCommand):
    help = (
        "Count the p-rld-md requests MD had in fact cached more than --threshold of (actual "
        "cached_tokens over prompt_tokens), against all relayed ones, and sum the estimated "
        "(routing decision) and actual (MD's reservation) cached tokens of the requests that "
        "went to MD."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--threshold",
            type=float,
            default=RELAYED_DESPITE_CACHE_THRESHOLD,
            help="Share of the prompt MD must have held (default 0.9).",
        )
        parser.add_argument("--hours", type=float, default=None, help="Only the last N hours.")
        parser.add_argument("--model", default="", help="Only this served model.")
        parser.add_argument("--status", default="", help="Only records with this status (ok).")
        parser.add_argument(
            "--json", action="store_true", dest="as_json", help="One JSON object on stdout."
        )

    def handle(self, *args, threshold, hours, model, status, as_json: bool, **options):
        if not 0.0 <= threshold <= 1.0:
            raise CommandError("--threshold: must be within 0..1")
        records = RequestRecord.objects.all()
        if hours is not None:
            records = records.filter(created_at__gte=timezone.now() - timedelta(hours=hours))
        if model:
            records = records.filter(model=model)
        if status:
            records = records.filter(status=status)
        summary = cache_estimate_summary(records, threshold)
        if as_json:
            self.stdout.write(json.dumps(summary, sort_keys=True))
            return
        share = summary["relayed_despite_cache_share"]
        self.stdout.write(
            f"relayed although MD held > {threshold:.0%} of the prompt: "
            f"{summary['relayed_despite_cache']} of {summary['relayed']} relayed requests"
            + (f" ({share:.1%})" if share is not None else "")
        )
        self.stdout.write(
            f"requests to MD: {summary['to_main_decode']}, prompt tokens "
            f"{summary['prompt_tokens']}, cached estimated {summary['estimated_cached_tokens']}"
            f" / actual {summary['actual_cached_tokens']}"
        )
