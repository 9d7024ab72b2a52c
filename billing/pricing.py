"""The price book: saving prices (overlap-checked, serialised per model) and finding the one in
force for a tenant, a model and an instant (the tenant's contract price first, else the list)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from billing.models import ModelPrice, Tenant
from fleet.models import ServedModel


def model_price_save(*, price: ModelPrice) -> ModelPrice:
    """Save a price after the overlap check, serialised per served model so two writers of
    overlapping periods can't both pass the check (the approach of fleet's unit prices)."""
    with transaction.atomic():
        ServedModel.objects.select_for_update().filter(pk=price.served_model_id).first()
        price.full_clean()
        price.save()
    return price


def price_in_force(*, tenant: Tenant, model: str, when: datetime) -> ModelPrice | None:
    """The tenant's contract price for the model at `when`, else the list price, else None."""
    prices = ModelPrice.objects.effective_at(when).filter(served_model__name=model)
    return (
        prices.filter(tenant=tenant).select_related("served_model").first()
        or prices.filter(tenant__isnull=True).select_related("served_model").first()
    )
