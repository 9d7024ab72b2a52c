from __future__ import annotations

from django.apps import AppConfig


class FrontendConfig(AppConfig):
    """Operator web UI and the live telemetry behind it."""

    name = "frontend"
    verbose_name = "Operator UI and telemetry"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from frontend.telemetry import observe
        from routing.gateway import records

        # Every request record the gateway writes feeds the live telemetry.
        if observe not in records.record_observers:
            records.record_observers.append(observe)
