# ApiKey's hash field takes the name every hashed token has (base/tokens.py): a
# rename, so every stored hash is kept.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0006_deleted_instance_runs"),
    ]

    operations = [
        migrations.RenameField(model_name="apikey", old_name="key_hash", new_name="digest"),
    ]
