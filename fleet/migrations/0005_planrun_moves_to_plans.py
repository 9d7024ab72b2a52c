"""PlanRun moves to the ``plans`` app (plans/migrations/0001_initial.py takes it over): only
Django's model state changes here; the table ``fleet_planrun`` and its rows stay as they are."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0004_planrun"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="PlanRun")],
            database_operations=[],
        ),
    ]
