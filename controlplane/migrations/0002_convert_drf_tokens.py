"""Convert DRF's plaintext tokens (``authtoken_token``) into hashed ApiTokens, then delete them.

Each old key keeps working: its ApiToken has the key's first 12 characters as prefix and the
SHA-256 of the key as digest. The table is read with plain SQL, when it exists, so that this
migration neither depends on ``rest_framework.authtoken`` nor breaks once it is uninstalled.
Not reversible in substance: the keys are gone, so going back leaves the ApiTokens alone.
"""

import hashlib
from datetime import UTC, datetime

from django.db import migrations
from django.utils import timezone
from django.utils.dateparse import parse_datetime

DRF_TABLE = "authtoken_token"
PREFIX_LENGTH = 12  # controlplane.models.PREFIX_LENGTH when this was written
NAME = "rest_framework.authtoken"


def _aware(value) -> datetime:
    if isinstance(value, str):
        value = parse_datetime(value)
    if not isinstance(value, datetime):
        return timezone.now()
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


def convert_plaintext_tokens(api_token_model, connection) -> int:
    """Move every row of DRF's token table into ``api_token_model``; how many were moved."""
    if DRF_TABLE not in connection.introspection.table_names():
        return 0
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {qn('key')}, {qn('user_id')}, {qn('created')} FROM {qn(DRF_TABLE)}")
        rows = cursor.fetchall()
    for key, user_id, created in rows:
        prefix = key[:PREFIX_LENGTH]
        digest = hashlib.sha256(key.encode()).hexdigest()
        existing = api_token_model.objects.filter(prefix=prefix).first()
        if existing is None:
            api_token_model.objects.create(
                user_id=user_id, name=NAME, prefix=prefix, digest=digest, created_at=_aware(created)
            )
        elif existing.digest != digest:
            raise RuntimeError(
                f"DRF token {prefix}...: an API token already has that prefix; "
                "revoke one of the two keys and migrate again"
            )
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {qn(DRF_TABLE)} WHERE {qn('key')} = %s", [key])
    return len(rows)


def forwards(apps, schema_editor):
    convert_plaintext_tokens(apps.get_model("controlplane", "ApiToken"), schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [("controlplane", "0001_initial")]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
