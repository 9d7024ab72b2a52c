"""Reading and changing the live routing policy."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from pdd.policy import PolicySettings
from routing.models import RoutingPolicyConfig


def policy_current() -> RoutingPolicyConfig:
    config, _ = RoutingPolicyConfig.objects.get_or_create(
        pk=1, defaults={"settings": PolicySettings().to_dict()}
    )
    return config


def policy_settings(config: RoutingPolicyConfig) -> PolicySettings:
    return PolicySettings.from_dict({**PolicySettings().to_dict(), **config.settings})


@transaction.atomic
def policy_update(*, changes: dict[str, Any], actor: str = "") -> RoutingPolicyConfig:
    """Apply a partial change; invalid values raise ValidationError naming the field."""
    config = (
        RoutingPolicyConfig.objects.select_for_update().filter(pk=1).first() or policy_current()
    )
    merged = {**PolicySettings().to_dict(), **config.settings, **changes}
    try:
        settings = PolicySettings.from_dict(merged)
    except (ValueError, TypeError) as exc:
        field, _, message = str(exc).partition(":")
        if field.strip() in merged:
            raise ValidationError({field.strip(): message.strip() or str(exc)}) from exc
        raise ValidationError({"settings": str(exc)}) from exc
    config.settings = settings.to_dict()
    config.version += 1
    config.updated_by = actor
    config.save()
    return config
