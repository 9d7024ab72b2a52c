"""Query-string filters that answer 400 for any value a database column cannot hold.

Date-times are turned into UTC before they reach the database: Python accepts UTC offsets up
to +-23:59, PostgreSQL only +-15:59 (``?until=0902-01-24T06:54:10-18:23`` was a 500 there).

django-filter turns ``?datacenter=9223372036854775808`` into a query that SQLite cannot bind
(``OverflowError``: a 500) and an integer filter's value into a ``Decimal`` (``1e400`` too).
Here every integer and foreign-key filter takes integers in the 64-bit range only, and the
filter backend builds ``filterset_fields`` filter sets on the same base.
"""

from __future__ import annotations

from datetime import UTC

import django_filters
from django import forms
from django.core.exceptions import ValidationError
from django.db import models
from django_filters.rest_framework import DjangoFilterBackend
from django_filters.rest_framework import FilterSet as RestFilterSet

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INTEGER_FIELDS = (
    models.AutoField,
    models.BigAutoField,
    models.SmallAutoField,
    models.IntegerField,
    models.BigIntegerField,
    models.SmallIntegerField,
    models.PositiveIntegerField,
    models.PositiveBigIntegerField,
    models.PositiveSmallIntegerField,
)


class BoundedIntegerField(forms.IntegerField):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("min_value", INT64_MIN)
        kwargs.setdefault("max_value", INT64_MAX)
        super().__init__(*args, **kwargs)


class BoundedModelChoiceField(django_filters.fields.ModelChoiceField):
    """A choice by primary key: a key that is not an integer the column can hold is simply
    not a valid choice (integer keys only; other keys are left to the queryset)."""

    def to_python(self, value):
        if value not in self.empty_values and isinstance(
            self.queryset.model._meta.pk, _INTEGER_FIELDS
        ):
            try:
                number = int(str(value))
            except ValueError:
                number = None
            if number is None or not INT64_MIN <= number <= INT64_MAX:
                raise ValidationError(self.error_messages["invalid_choice"], code="invalid_choice")
        return super().to_python(value)


class IdFilter(django_filters.NumberFilter):
    """An integer (id) filter: whole numbers in the 64-bit range."""

    field_class = BoundedIntegerField


class BoundedModelChoiceFilter(django_filters.ModelChoiceFilter):
    field_class = BoundedModelChoiceField


def _bounded_defaults(defaults: dict) -> dict:
    found = dict(defaults)
    for field in _INTEGER_FIELDS:
        found[field] = {"filter_class": IdFilter}
    for relation in (models.ForeignKey, models.OneToOneField):
        entry = dict(defaults[relation])
        entry["filter_class"] = BoundedModelChoiceFilter
        found[relation] = entry
    return found


def _utc_field(base: type[forms.Field]) -> type[forms.Field]:
    # The base is the filter's own field class, known only when the filter set is built;
    # mypy cannot check a class statement whose base is a variable.
    class UTCDateTimeField(base):  # type: ignore[valid-type, misc]
        def to_python(self, value):
            found = super().to_python(value)
            if found is None or found.tzinfo is None:
                return found
            try:
                return found.astimezone(UTC)
            except (OverflowError, ValueError):
                raise ValidationError(
                    "Enter a date-time that lies between years 1 and 9999 in UTC.", code="invalid"
                ) from None

    UTCDateTimeField.__name__ = f"UTC{base.__name__}"
    return UTCDateTimeField


class BoundedFilterSet(RestFilterSet):
    FILTER_DEFAULTS = _bounded_defaults(RestFilterSet.FILTER_DEFAULTS)

    @classmethod
    def get_filters(cls):
        """The class's filters (built once, when the class is made), date-times in UTC."""
        filters = super().get_filters()
        for item in filters.values():
            if isinstance(item, django_filters.DateTimeFilter) and not getattr(
                item.field_class, "_utc", False
            ):
                item.field_class = _utc_field(item.field_class)
                item.field_class._utc = True
        return filters


class BoundedFilterBackend(DjangoFilterBackend):
    filterset_base = BoundedFilterSet
