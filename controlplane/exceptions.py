"""API error shape: DRF's field -> messages map, plus database errors turned into 400s."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import exception_handler, set_rollback


def api_exception_handler(exc, context):
    if isinstance(exc, DjangoValidationError):
        set_rollback()
        # Model clean()/service errors that escaped a serializer still name their field.
        return Response(as_serializer_error(exc), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, IntegrityError):
        # A race past the serializer's checks: roll the atomic request back, answer 400.
        set_rollback()
        return Response(
            {"detail": f"the change conflicts with existing data: {exc}".splitlines()[0]},
            status=status.HTTP_400_BAD_REQUEST,
        )
    return exception_handler(exc, context)
