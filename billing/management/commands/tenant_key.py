"""Issue an API key for a tenant (created if missing) and print it."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from billing import services
from billing.models import Tenant


class Command(BaseCommand):
    help = "Issue an API key for a tenant (creating the tenant if needed) and print the key."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("--name", default="cli", help="What the key is for.")
        parser.add_argument("--rpm", type=int, help="Requests per minute (new tenants).")
        parser.add_argument("--tpm", type=int, help="Tokens per minute (new tenants).")

    def handle(self, *args, tenant: str, name: str, rpm: int | None, tpm: int | None, **opts):
        found = Tenant.objects.filter(name=tenant).first()
        if found is None:
            found = Tenant(name=tenant)
            if rpm is not None:
                found.requests_per_minute = rpm
            if tpm is not None:
                found.tokens_per_minute = tpm
            try:
                found.full_clean()
            except ValidationError as exc:
                raise CommandError(
                    "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
                ) from exc
            found.save()
            self.stderr.write(f"created tenant {tenant}")
        _, raw = services.api_key_create(tenant=found, name=name)
        self.stdout.write(raw)
