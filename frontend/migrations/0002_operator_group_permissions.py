"""Give the operator group the model permissions of the project's apps, so the admin is usable
by operators (baton_user makes them staff; without permissions the admin index says "You don't
have permission to view or edit anything."). Viewers get no admin permissions: they are never
staff. Users, groups and API tokens other than viewing them stay superuser work."""

from django.conf import settings
from django.db import migrations

OPERATOR_APPS = ("fleet", "billing", "routing", "frontend")
VIEW_ONLY_APPS = ("controlplane",)


def grant(apps, schema_editor):
    from django.contrib.auth.management import create_permissions

    # Permissions are normally made after migrate (post_migrate); make them now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    group_model = apps.get_model("auth", "Group")
    permission = apps.get_model("auth", "Permission")
    group, _ = group_model.objects.get_or_create(name=settings.BATON_OPERATOR_GROUP)
    perms = permission.objects.filter(content_type__app_label__in=OPERATOR_APPS)
    views = permission.objects.filter(
        content_type__app_label__in=VIEW_ONLY_APPS, codename__startswith="view_"
    )
    group.permissions.add(*perms, *views)


def revoke(apps, schema_editor):
    group_model = apps.get_model("auth", "Group")
    group = group_model.objects.filter(name=settings.BATON_OPERATOR_GROUP).first()
    if group is not None:
        group.permissions.clear()


class Migration(migrations.Migration):
    dependencies = [
        ("frontend", "0001_initial"),
        ("fleet", "0004_planrun"),
        ("billing", "0006_deleted_instance_runs"),
        ("routing", "0007_cache_version"),
        ("controlplane", "0002_convert_drf_tokens"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [migrations.RunPython(grant, revoke)]
