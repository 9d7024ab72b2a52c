"""The OpenAPI schema's generator (drf-spectacular's, extended here).

drf-spectacular documents only the success answer of each operation. ``BatonAutoSchema`` adds
the error answers the API really gives, with their bodies as DRF and
``controlplane.exceptions.api_exception_handler`` send them:

* 400 ``ValidationErrorMap`` (field -> messages; nested serializers nest; ``non_field_errors``
  for errors of the whole object), ``ErrorDetail`` (parse errors, rows still in use,
  integrity conflicts) or ``ValidationErrorList`` (messages naming no field), for operations
  that read a body or query parameters or change rows;
* 401 ``ErrorDetail`` with ``WWW-Authenticate`` where the view authenticates;
* 403 ``ErrorDetail`` where a permission can refuse (viewers writing, CSRF of session calls);
* 404 ``ErrorDetail`` for operations with a path parameter, and for paginated lists
  (``?page=`` past the end);
* 408, 413 and 415 ``ErrorDetail`` for operations with a request body (a body too slow to
  arrive, too large: controlplane.limits; of a Content-Type the view does not parse);
* 409 and 503 ``ErrorDetail`` where a view says it answers them (``schema_error_codes``);
* 429 ``ErrorDetail`` with ``Retry-After`` where the view has throttles.

Read-only choice fields of model fields with ``blank=True`` keep ``""`` among their values:
DRF drops ``allow_blank`` from read-only fields, but such rows (a request record routed to no
pipeline) really answer ``""``.

No documented operation answers 405: DRF gives it only to methods the schema does not list.
Codes a view declares itself (``@extend_schema(responses={404: ...})``) are kept as declared.

Each /api/v1 operation is tagged with its app (``fleet``, ``billing``, ``routing``), the planner's
runs (``/api/v1/plans/``) with ``planner`` and the node agents' calls (``/api/v1/agent/``) with
``agents``, unless the view names its own tags; the OpenAI-compatible gateway's /v1 operations
(``openai``) come from routing/gateway/openapi.py.
"""

from __future__ import annotations

from django.core.exceptions import FieldDoesNotExist
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import serializers
from rest_framework.permissions import AllowAny


# Component ``ErrorDetail``; a view that declares an error answer itself uses it too:
# ``@extend_schema(responses={..., 404: OpenApiResponse(ErrorDetailSerializer, "...")})``.
class ErrorDetailSerializer(serializers.Serializer):
    """An error that concerns the request as a whole."""

    detail = serializers.CharField(help_text="What went wrong.")
    code = serializers.CharField(
        required=False,
        help_text="A machine-readable reason, where one is given (e.g. body_too_large).",
    )


# The shared components of invalid input (no serializer can say "any field name").
VALIDATION_ERROR_MAP = "ValidationErrorMap"
VALIDATION_ERROR_LIST = "ValidationErrorList"

_MESSAGES = {
    "description": "The messages about one field: a list of messages, a message, or, for a "
    "nested serializer or a list of them, the same map (or a list of maps) one level down.",
    "anyOf": [
        {"type": "array", "items": {}},
        {"type": "string"},
        {"type": "object", "additionalProperties": {}},
    ],
}

COMPONENT_SCHEMAS: dict[str, dict] = {
    VALIDATION_ERROR_MAP: {
        "type": "object",
        "description": "Invalid input: each offending field (or ``non_field_errors``) maps to "
        'its messages, e.g. ``{"name": ["This field is required."]}``.',
        "additionalProperties": _MESSAGES,
    },
    VALIDATION_ERROR_LIST: {
        "type": "array",
        "description": "Invalid input that names no field, e.g. a ``?search=`` term with a NUL "
        'character (DRF\'s SearchFilter): ``["Null characters are not allowed."]``.',
        "items": {"type": "string"},
    },
}

DESCRIPTIONS = {
    "400": "Invalid input: a field -> messages map, a detail for the request as a whole, or a "
    "list of messages that name no field.",
    "401": "No credentials, or unknown, malformed or revoked ones.",
    "403": "Authenticated, but not allowed: viewers may only read; session calls need CSRF.",
    "404": "No such object (or no such page of a list).",
    "408": "The request body took longer than BATON_BODY_TIMEOUT_S to arrive.",
    "409": "The request conflicts with the object's current state.",
    "413": "The request body is larger than the server accepts.",
    "415": "The request body's Content-Type is not one the operation parses.",
    "429": "Too many requests: wait as Retry-After says.",
    "503": "A service the operation needs is unavailable right now; retry later.",
}

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}

# Tags by path prefix (checked first), else the view's app.
PATH_TAGS = (
    ("/api/v1/plans/", "planner"),
    ("/api/v1/autopilot/", "planner"),
    ("/api/v1/agent/", "agents"),
)


class BatonAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema; the one place the schema's conventions are extended."""

    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        responses = operation.setdefault("responses", {})
        for code in self.error_codes(operation):
            if str(code) not in responses:  # a view's own declaration wins
                responses[str(code)] = self._error_response(str(code))
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def get_tags(self) -> list[str]:
        """The view's app (a path prefix of PATH_TAGS first); ``@extend_schema(tags=...)``
        overrides this method, so a view's own tags win."""
        for prefix, tag in PATH_TAGS:
            if self.path.startswith(prefix):
                return [tag]
        return [type(self.view).__module__.split(".", 1)[0]]

    def _map_serializer_field(self, field, direction, bypass_extensions=False):
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if (
            isinstance(field, serializers.ChoiceField)
            and field.read_only
            and isinstance(schema, dict)
            and "" not in schema.get("enum", [""])
            and _model_field_allows_blank(field)
        ):
            values = [v for v in schema["enum"] if v is not None]
            nullable = [None] if None in schema["enum"] else []
            schema = {**schema, "enum": [*values, "", *nullable]}
        return schema

    def error_codes(self, operation: dict) -> list[int]:
        """The 4xx/5xx codes this operation can answer, from what its view does."""
        view = self.view
        params = operation.get("parameters", [])
        has_path_param = any(p.get("in") == "path" for p in params)
        has_query = any(p.get("in") == "query" for p in params)
        has_body = "requestBody" in operation
        # Filter backends validate their query parameters on every GenericAPIView action,
        # retrieve included (get_object filters the queryset), e.g. ``?search=`` with a NUL.
        filters = bool(getattr(view, "filter_backends", ()))

        codes: set[int] = set()
        if has_body or has_query or filters or self.method in WRITE_METHODS:
            codes.add(400)
        if view.get_authenticators():
            codes.add(401)
        if not all(isinstance(p, AllowAny) for p in view.get_permissions()):
            codes.add(403)
        if has_path_param:
            codes.add(404)
        if self.method == "GET" and self._is_list_view() and self._get_paginator():
            codes.add(404)
        if has_body:
            codes.update((408, 413, 415))
        if view.get_throttles():
            codes.add(429)
        codes.update(self._declared_error_codes())
        return sorted(codes)

    def _declared_error_codes(self) -> set[int]:
        """``schema_error_codes`` on the view: {action or method: [codes]} or [codes]."""
        declared = getattr(self.view, "schema_error_codes", None)
        if not declared:
            return set()
        if isinstance(declared, dict):
            action = getattr(self.view, "action", None)
            return set(declared.get(action, ())) | set(declared.get(self.method.lower(), ()))
        return set(declared)

    def _component_ref(self, name: str) -> dict:
        component = ResolvedComponent(
            name=name,
            type=ResolvedComponent.SCHEMA,
            object=name,
            schema=COMPONENT_SCHEMAS[name],
        )
        self.registry.register_on_missing(component)
        return component.ref

    def _error_detail_ref(self) -> dict:
        return self.resolve_serializer(ErrorDetailSerializer(), "response").ref

    def _error_response(self, code: str) -> dict:
        if code == "400":
            schema = {
                "anyOf": [
                    self._component_ref(VALIDATION_ERROR_MAP),
                    self._error_detail_ref(),
                    self._component_ref(VALIDATION_ERROR_LIST),
                ]
            }
        else:
            schema = self._error_detail_ref()
        response: dict = {
            "description": DESCRIPTIONS.get(code, "Error."),
            "content": {"application/json": {"schema": schema}},
        }
        if code == "401":
            response["headers"] = {
                "WWW-Authenticate": {
                    "description": "The scheme to authenticate with, e.g. 'Token'.",
                    "schema": {"type": "string"},
                }
            }
        elif code == "429":
            response["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before the next request.",
                    "schema": {"type": "integer"},
                }
            }
        return response


def _model_field_allows_blank(field) -> bool:
    """Whether the model field behind a ModelSerializer's field accepts ``""``."""
    model = getattr(getattr(field.parent, "Meta", None), "model", None)
    source = getattr(field, "source", "")
    if model is None or not source or source == "*" or "." in source:
        return False
    try:
        return bool(model._meta.get_field(source).blank)
    except FieldDoesNotExist:
        return False
