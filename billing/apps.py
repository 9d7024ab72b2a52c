from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from billing.costs import keep_runs_of_deleted_instance

        pre_delete.connect(
            keep_runs_of_deleted_instance,
            sender="fleet.Instance",
            dispatch_uid="billing.keep_runs_of_deleted_instance",
        )
