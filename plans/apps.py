from django.apps import AppConfig


class PlansConfig(AppConfig):
    name = "plans"
    verbose_name = "Capacity plans"
    default_auto_field = "django.db.models.BigAutoField"
