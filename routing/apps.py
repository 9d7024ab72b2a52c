from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from routing.gateway.caches import connect_invalidation
        from routing.live import connect_topology_invalidation

        connect_invalidation()
        connect_topology_invalidation()
