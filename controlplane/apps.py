from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Control plane"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Every process kind (web, worker, beat, manage.py) registers every app's Celery tasks
        # at start-up. Celery's autodiscovery is lazy: a web process that had not enqueued a
        # task yet ran the embedded beat into NotRegistered('fleet.health_check') for ever.
        from controlplane.celery import app
        from controlplane.push import connect_pushes

        app.autodiscover_tasks(force=True)
        # The apps' change signals reach the dashboards' websocket groups.
        connect_pushes()
