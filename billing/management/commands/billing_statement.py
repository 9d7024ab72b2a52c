"""Print a tenant's statement for a month (stored, rated first) or any [start, end) range."""

from __future__ import annotations

import json
from datetime import UTC

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from billing import statements
from billing.api.serializers import StatementSerializer, statement_csv
from billing.models import Statement, Tenant


def _instant(text: str, name: str):
    value = parse_datetime(text)
    if value is None:
        raise CommandError(f"--{name}: use an ISO 8601 date-time, e.g. 2026-01-01T00:00:00Z.")
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value


class Command(BaseCommand):
    help = (
        "Print a tenant's statement: --month YYYY-MM (the stored monthly statement, after "
        "rating pending usage; the current month by default) or --start/--end (a preview of "
        "any range, worked out from the ledger)."
    )

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="Tenant name.")
        parser.add_argument("--month", help="YYYY-MM (UTC).")
        parser.add_argument("--start", help="Start of a custom range (inclusive, ISO 8601).")
        parser.add_argument("--end", help="End of a custom range (exclusive, ISO 8601).")
        parser.add_argument("--format", choices=["json", "csv"], default="json")

    def handle(self, *args, tenant, month, start, end, format, **opts):
        found = Tenant.objects.filter(name=tenant).first()
        if found is None:
            raise CommandError(f"No tenant named {tenant!r}.")
        if month and (start or end):
            raise CommandError("Give either --month or --start/--end, not both.")
        if start or end:
            if not (start and end):
                raise CommandError("--start and --end go together.")
            try:
                statement = statements.preview(
                    tenant=found, start=_instant(start, "start"), end=_instant(end, "end")
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        else:
            try:
                period_start, period_end = (
                    statements.parse_month(month)
                    if month
                    else (statements.month_start(timezone.now()), None)
                )
            except ValueError as exc:
                raise CommandError(f"--month: {exc}") from exc
            period_end = period_end or statements.next_month(period_start)
            statements.rate_pending()
            statements.refresh_open(tenant=found)
            statement = Statement.objects.filter(tenant=found, period_start=period_start).first()
            if statement is None:  # no usage that month: an empty statement, not stored
                statement = statements.preview(tenant=found, start=period_start, end=period_end)
        document = StatementSerializer(statement).data
        if format == "csv":
            self.stdout.write(statement_csv(document), ending="")
        else:
            self.stdout.write(json.dumps(document, indent=2))
