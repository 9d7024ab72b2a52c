"""The API agents speak: registration and heartbeats, authenticated by the node's agent token."""

from __future__ import annotations

import time

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import connection, transaction
from django.utils.functional import cached_property
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import (
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from base.schema import ErrorDetailSerializer
from fleet import agent_services, beats, kv_index, services
from fleet.endpoints import check_agent_address, check_agent_endpoint, check_agent_port
from fleet.models import Instance, Node


class AgentPrincipal:
    """request.user for agent calls: a node, never a Django user, so operator views refuse it."""

    is_authenticated = True
    is_staff = False
    is_superuser = False
    is_anonymous = False

    def __init__(self, node: Node) -> None:
        self.node = node
        self.username = f"agent:{node.hostname}"

    @cached_property
    def groups(self):
        from django.contrib.auth.models import Group

        return Group.objects.none()


class AgentTokenAuthentication(BaseAuthentication):
    keyword = b"agenttoken"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Malformed AgentToken header: use 'AgentToken <token>'.")
        node = services.node_authenticate_token(parts[1].decode(errors="replace"))
        if node is None:
            raise AuthenticationFailed("Unknown or revoked agent token.")
        return AgentPrincipal(node), node

    def authenticate_header(self, request) -> str:
        return "AgentToken"


class IsAgent(BasePermission):
    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, AgentPrincipal)


def _policy_error(exc: DjangoValidationError) -> serializers.ValidationError:
    return serializers.ValidationError(exc.messages)


class KVEndpointSerializer(serializers.Serializer):
    """Where an instance's KV fabrics listen. The gateway hands it to the other agents of a
    request, which connect to it with the data-plane token: the agent endpoint policy
    applies (fleet.endpoints)."""

    host = serializers.CharField(max_length=253)
    port = serializers.IntegerField(min_value=1, max_value=65535)
    wan_port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, allow_null=True
    )

    def validate(self, attrs):
        try:
            check_agent_address(attrs["host"], attrs["port"])
        except DjangoValidationError as exc:
            field = "port" if exc.code == "port" else "host"
            raise serializers.ValidationError({field: exc.messages}) from None
        if attrs.get("wan_port") is not None:
            try:
                check_agent_port(attrs["wan_port"])
            except DjangoValidationError as exc:
                raise serializers.ValidationError({"wan_port": exc.messages}) from None
        return attrs


# Bounds of a heartbeat or registration report, beside its size in bytes.
MAX_REPORTED_INSTANCES = 256
MAX_REPORTED_BLOCKS = 200_000


@extend_schema_field(
    {"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 200_000}
)
class BlockHashListField(serializers.Field):
    """A list of block hashes (strings of at most 64 characters), checked in one pass: a
    CharField per hash cost ~70% of a heartbeat's CPU with thousands of them."""

    default_error_messages = {
        "not_a_list": "Expected a list of block hashes.",
        "too_long": f"At most {MAX_REPORTED_BLOCKS} block hashes.",
        "bad_item": "Every block hash must be a string of 1-64 characters.",
    }

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("not_a_list")
        if len(data) > MAX_REPORTED_BLOCKS:
            self.fail("too_long")
        if not all(type(h) is str and 0 < len(h) <= 64 for h in data):
            self.fail("bad_item")
        return data

    def to_representation(self, value):
        return value


class InstanceReportSerializer(serializers.Serializer):
    instance_id = serializers.CharField(max_length=64)
    role = serializers.CharField(max_length=32, required=False)
    model = serializers.CharField(max_length=128, required=False, allow_blank=True)
    state = serializers.ChoiceField(choices=list(agent_services.REPORTED_STATES))
    load = serializers.DictField(required=False)
    kv = serializers.DictField(required=False)
    cache = serializers.DictField(required=False)
    tokens_generated = serializers.IntegerField(required=False, min_value=0)
    kv_endpoint = KVEndpointSerializer(required=False, allow_null=True)
    # Prefix-block hashes of the KV on its way to a main decoder (reserved, not imported yet):
    # bounded, as the whole report is (BATON_MAX_HEARTBEAT_BYTES). What the cache holds is
    # not in the heartbeat: it comes as KV cache events (AgentKVEventsView).
    incoming_prefix_blocks = BlockHashListField(required=False)
    # Where the instance's KV cache events stand (agents/node/kv_events.py summary()).
    kv_events = serializers.DictField(required=False)


class StateDocumentSerializer(serializers.Serializer):
    node = serializers.CharField(max_length=253, required=False, allow_blank=True, allow_null=True)
    datacenter = serializers.CharField(
        max_length=64, required=False, allow_blank=True, allow_null=True
    )
    protocol = serializers.IntegerField(required=False)
    draining = serializers.BooleanField(required=False)
    instances = InstanceReportSerializer(many=True, max_length=MAX_REPORTED_INSTANCES)
    fabrics = serializers.DictField(required=False)
    links = serializers.DictField(required=False)


class RegisterSerializer(StateDocumentSerializer):
    endpoint = serializers.CharField(
        max_length=512,
        help_text=(
            "Base URL the agent serves on, http(s)://host:port; it must pass the agent "
            "endpoint policy (BATON_AGENT_NETWORKS, docs/security.md)."
        ),
    )

    def validate_endpoint(self, value: str) -> str:
        try:
            return check_agent_endpoint(value)
        except DjangoValidationError as exc:
            raise _policy_error(exc) from None


class AgentView(APIView):
    authentication_classes = [AgentTokenAuthentication]
    permission_classes = [IsAgent]

    def dispatch(self, request, *args, **kwargs):
        """The view, its start, end and time in database statements noted on the ASGI scope
        (``baton.view``), for the slow-call log (controlplane/middleware.py)."""
        scope = getattr(request, "scope", None)
        if not isinstance(scope, dict):
            return super().dispatch(request, *args, **kwargs)
        began, in_db = time.monotonic(), [0.0]

        def timed(execute, sql, params, many, context):
            start = time.monotonic()
            try:
                return execute(sql, params, many, context)
            finally:
                in_db[0] += time.monotonic() - start

        try:
            with connection.execute_wrapper(timed):
                return super().dispatch(request, *args, **kwargs)
        finally:
            scope["baton.view"] = (began, time.monotonic(), in_db[0])


class AgentRegisterView(AgentView):
    """An agent announces the endpoint it serves on and gets its command token and settings."""

    @extend_schema(
        request=RegisterSerializer,
        responses=inline_serializer(
            "AgentRegistration",
            {
                "node_id": serializers.IntegerField(),
                "hostname": serializers.CharField(),
                "datacenter": serializers.CharField(),
                "heartbeat_interval_s": serializers.FloatField(),
                "command_token": serializers.CharField(),
                "links": serializers.DictField(),
                "data_token": serializers.CharField(
                    required=False,
                    help_text="the fleet's data-plane token, when BATON_DATA_TOKEN is set",
                ),
            },
        ),
    )
    def post(self, request):
        body = RegisterSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        report = {
            k: v
            for k, v in agent_services.without_cache_lists(request.data).items()
            if k != "endpoint"
        }
        return Response(
            agent_services.node_register(
                node=request.user.node, endpoint=body.validated_data["endpoint"], report=report
            )
        )


class AgentHeartbeatView(AgentView):
    """An agent reports what it runs and its live load."""

    @extend_schema(
        request=StateDocumentSerializer,
        responses={
            200: inline_serializer("AgentHeartbeatAck", {"ok": serializers.BooleanField()}),
            404: OpenApiResponse(
                ErrorDetailSerializer, description="The node has not registered yet."
            ),
        },
    )
    def post(self, request):
        node = request.user.node
        data = request.data
        if isinstance(data, dict):
            data = agent_services.without_cache_lists(data)
        digest = agent_services.report_digest(data)
        if node.registered_at is not None and agent_services.node_heartbeat_unchanged(
            node=node, report=data, digest=digest
        ):
            # The same document as the node's last full heartbeat, which was validated.
            return Response({"ok": True})
        if not agent_services.validated_before(node.pk, digest):
            StateDocumentSerializer(data=data).is_valid(raise_exception=True)
        if node.registered_at is None:
            # Commands need the endpoint and command token that only registration hands out.
            return Response({"detail": "Register first."}, status=404)
        agent_services.node_heartbeat(node=node, report=data, digest=digest)
        # The next beats that repeat this one may be taken before Django (fleet.beats).
        token = get_authorization_header(request).split()[1].decode(errors="replace")
        transaction.on_commit(lambda: beats.remember(token, node.pk))
        return Response({"ok": True})


class KVEventsInstanceSerializer(serializers.Serializer):
    """One instance's batches (documented shape; the view checks the events in one pass)."""

    instance_id = serializers.CharField(max_length=64)
    epoch = serializers.CharField(max_length=64)
    seq = serializers.IntegerField(min_value=0)
    batches = serializers.ListField(child=serializers.DictField(), required=False)


class KVEventsSerializer(serializers.Serializer):
    instances = KVEventsInstanceSerializer(many=True, max_length=MAX_REPORTED_INSTANCES)


class AgentKVEventsView(AgentView):
    """An agent's KV cache events: what each of its decode instances' prefix caches stored and
    removed, in numbered batches, for the prefix index the gateways route on
    (fleet/kv_index.py; docs/PROTOCOL.md "KV cache events"). The answer, per instance: the
    last batch the index holds (``acked``) and, when it cannot apply what came, ``resync``
    with the reason: the agent then sends a snapshot of its cache."""

    @extend_schema(
        request=KVEventsSerializer,
        responses={
            200: inline_serializer(
                "AgentKVEventsAck",
                {"instances": serializers.DictField(child=serializers.DictField())},
            ),
            404: OpenApiResponse(
                ErrorDetailSerializer, description="The node has not registered yet."
            ),
        },
    )
    def post(self, request):
        node = request.user.node
        if node.registered_at is None:
            return Response({"detail": "Register first."}, status=404)
        items = request.data.get("instances") if isinstance(request.data, dict) else None
        if not isinstance(items, list):
            raise serializers.ValidationError({"instances": ["Expected a list of instances."]})
        if len(items) > MAX_REPORTED_INSTANCES:
            raise serializers.ValidationError(
                {"instances": [f"At most {MAX_REPORTED_INSTANCES} instances."]}
            )
        parsed = []
        for i, item in enumerate(items):
            where = f"instances[{i}]"
            if not isinstance(item, dict):
                raise serializers.ValidationError({where: ["Expected an object."]})
            iid, epoch, seq = item.get("instance_id"), item.get("epoch"), item.get("seq")
            if not isinstance(iid, str) or not iid or len(iid) > 64:
                raise serializers.ValidationError({f"{where}.instance_id": ["Required string."]})
            if not isinstance(epoch, str) or not epoch or len(epoch) > 64:
                raise serializers.ValidationError({f"{where}.epoch": ["Required string."]})
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                raise serializers.ValidationError({f"{where}.seq": ["An integer >= 0."]})
            batches = item.get("batches") or []
            if not isinstance(batches, list):
                raise serializers.ValidationError({f"{where}.batches": ["Expected a list."]})
            try:
                parsed.append(
                    (iid, epoch, seq, [
                        kv_index.parse_batch(b, f"{where}.batches[{j}]")
                        for j, b in enumerate(batches)
                    ])
                )  # fmt: skip
            except kv_index.IndexError_ as exc:
                field, _, reason = str(exc).partition(": ")
                raise serializers.ValidationError({field: [reason]}) from None
        own = {str(pk) for pk in Instance.objects.filter(node=node).values_list("pk", flat=True)}
        index = kv_index.prefix_index()
        answers = {}
        for iid, epoch, seq, batches in parsed:
            if iid not in own:
                answers[iid] = {"acked": 0, "error": "not an instance of this node"}
                continue
            answers[iid] = index.apply(iid, epoch, seq, batches)
        return Response({"instances": answers})


class AgentTokenScheme(OpenApiAuthenticationExtension):
    """Documents the AgentToken header in the OpenAPI schema."""

    target_class = "fleet.api.agent.AgentTokenAuthentication"
    name = "agentToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "'AgentToken <token>': the node's agent token.",
        }
