from __future__ import annotations

from django.apps import AppConfig


class FrontendConfig(AppConfig):
    """Operator web UI and the live telemetry behind it."""

    name = "frontend"
    verbose_name = "Operator UI and telemetry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from billing import margin
        from frontend.telemetry import observe
        from frontend.telemetry.service import live_bcr, observe_error
        from routing.gateway import errors, records

        # Every request record the gateway writes feeds the live telemetry.
        if observe not in records.record_observers:
            records.record_observers.append(observe)
        # And every error answer it sends (4xx/5xx by tenant and code, /metrics).
        if observe_error not in errors.error_observers:
            errors.error_observers.append(observe_error)
        # Billing's margin shows the live BCR from this telemetry.
        margin.live_bcr_source = live_bcr
