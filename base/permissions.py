"""API roles: operators (staff or the operator group) write, viewers read."""

from __future__ import annotations

from django.conf import settings
from rest_framework.permissions import SAFE_METHODS, BasePermission


def user_is_operator(user) -> bool:
    if not (user and user.is_authenticated):
        return False
    if user.is_staff or user.is_superuser:
        return True
    return user.groups.filter(name=settings.BATON_OPERATOR_GROUP).exists()


class IsOperatorOrReadOnly(BasePermission):
    """Any authenticated user may read; only operators may change anything."""

    message = "Only operators may change the fleet; viewers have read-only access."

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False
        if request.method in SAFE_METHODS:
            return True
        return user_is_operator(user)
