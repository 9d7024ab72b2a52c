"""PlanRun, moved from ``fleet`` (fleet/migrations/0005_planrun_moves_to_plans.py): the state
is created over the table fleet/migrations/0004_planrun.py made, which keeps its name and rows;
its content type follows, so permissions and admin history stay attached to it."""

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def content_type_to_plans(apps, schema_editor):
    content_type = apps.get_model("contenttypes", "ContentType")
    if not content_type.objects.filter(app_label="plans", model="planrun").exists():
        content_type.objects.filter(app_label="fleet", model="planrun").update(app_label="plans")


def content_type_to_fleet(apps, schema_editor):
    content_type = apps.get_model("contenttypes", "ContentType")
    if not content_type.objects.filter(app_label="fleet", model="planrun").exists():
        content_type.objects.filter(app_label="plans", model="planrun").update(app_label="fleet")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("fleet", "0005_planrun_moves_to_plans"),
        ("contenttypes", "0002_remove_content_type_name"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="PlanRun",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("status", models.CharField(choices=[("queued", "Queued"), ("running", "Running"), ("done", "Done"), ("failed", "Failed")], default="queued", help_text="queued, running, done or failed; only a queued run may start.", max_length=16)),
                        ("scenario", models.CharField(help_text="Bundled planner scenario the model, engine, workload, SLA and policy come from.", max_length=64)),
                        ("top", models.PositiveSmallIntegerField(default=5, help_text="How many of the best configurations to keep.", validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(20)])),
                        ("inputs", models.JSONField(blank=True, default=dict, help_text="What the planner is given: fleet spec (per-node units and prices from the database at creation), workload, SLA, search space, the requested counts and notes.")),
                        ("results", models.JSONField(blank=True, default=list, help_text="Best configurations, best BCR first: counts, goodput req/s, cost/h, BCR.")),
                        ("error", models.TextField(blank=True, help_text="Why the run failed, if it did.")),
                        ("progress_done", models.PositiveIntegerField(default=0, help_text="Configurations simulated so far.")),
                        ("progress_total", models.PositiveIntegerField(default=0, help_text="Configurations in the search.")),
                        ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                        ("started_at", models.DateTimeField(blank=True, help_text="When a worker started the search.", null=True)),
                        ("finished_at", models.DateTimeField(blank=True, help_text="When the search finished or failed.", null=True)),
                        ("created_by", models.ForeignKey(blank=True, help_text="Who asked for the plan.", null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="plan_runs", to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        "verbose_name": "plan run",
                        "db_table": "fleet_planrun",
                        "ordering": ["-created_at", "-id"],
                        "constraints": [models.CheckConstraint(condition=models.Q(("progress_done__lte", models.F("progress_total"))), name="planrun_progress_within_total")],
                    },
                ),
            ],
        ),
        migrations.RunPython(content_type_to_plans, content_type_to_fleet),
    ]
