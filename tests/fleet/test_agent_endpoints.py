"""The agent endpoint policy (fleet.endpoints): what registration, an operator's edit, the model,
the heartbeat's KV endpoints and every control-plane call to an agent refuse, and why."""

from __future__ import annotations

import socket

import httpx
import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.utils import timezone
from rest_framework.test import APIClient

from fleet import agent_services, endpoints, services
from fleet.agent_client import (
    AgentClient,
    AgentEndpointRefused,
    AgentEndpointUnresolvable,
    AgentError,
    AgentUnreachable,
)
from fleet.choices import NodeStatus
from fleet.endpoints import check_agent_endpoint
from fleet.models import FleetEvent, Node, WANLink

pytestmark = pytest.mark.django_db

# The URLs of the finding, then others the policy must refuse with the default networks.
FINDING = [
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]:1/",
    "ftp://10.0.0.5:9000/",
    "http://user:pw@127.0.0.1:1/",
]
REFUSED = [
    *FINDING,
    "http://169.254.169.254:9000",
    "http://[::ffff:169.254.169.254]:9000",
    "http://[fd00:ec2::254]:9000",
    "http://100.100.100.200:9000",
    "http://169.254.170.2:9000",
    "http://[fe80::1]:9000",
    "http://0.0.0.0:9000",
    "http://[::]:9000",
    "http://224.0.0.1:9000",
    "http://255.255.255.255:9000",
    "http://8.8.8.8:9000",
    "http://2130706433:9000",
    "http://127.0.0.1:22",
    "http://127.0.0.1:9000/v1",
    "http://127.0.0.1:9000/?x=1",
    "gopher://127.0.0.1:9000",
    "http://:9000",
]


def fake_dns(table: dict[str, list[str]]):
    """A getaddrinfo answering from `table` (name -> addresses); unknown names fail."""

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (a, port, 0, 0) if ":" in a else (a, port),
            )
            for a in table[host]
        ]

    return getaddrinfo


def agent_api(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"AgentToken {token}")
    return client


def register(token: str, endpoint: str, instances: list | None = None):
    body = {"node": "a-1", "datacenter": "dc-a", "protocol": 1, "instances": instances or []}
    return agent_api(token).post(
        "/api/v1/agent/register", {**body, "endpoint": endpoint}, format="json"
    )


@pytest.fixture
def token_a(node_a) -> str:
    return services.node_rotate_token(node=node_a)


@pytest.fixture
def registered_a(node_a, token_a) -> Node:
    response = register(token_a, "http://10.0.0.5:9000")
    assert response.status_code == 200, response.json()
    node_a.refresh_from_db()
    return node_a


def snapshot(node: Node) -> tuple:
    node.refresh_from_db()
    return (node.agent_endpoint, node.command_token, node.registered_at, node.updated_at)


# --- the policy itself ----------------------------------------------------------------------


@pytest.mark.parametrize("url", REFUSED)
def test_the_policy_refuses(url):
    with pytest.raises(ValidationError):
        check_agent_endpoint(url)


@pytest.mark.parametrize(
    ("url", "normalised"),
    [
        ("http://127.0.0.1:9101", "http://127.0.0.1:9101"),
        ("HTTP://127.0.0.1:9101/", "http://127.0.0.1:9101"),
        ("https://10.1.2.3", "https://10.1.2.3"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("http://[FD12::5]:9000/", "http://[fd12::5]:9000"),
        ("http://192.168.1.20:80", "http://192.168.1.20:80"),
        ("http://[::ffff:10.0.0.5]:9000", "http://[::ffff:a00:5]:9000"),
    ],
)
def test_the_policy_allows_and_normalises(url, normalised):
    assert check_agent_endpoint(url) == normalised


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://10.0.0.5:9000/", "http:// or https://"),
        ("http://user:pw@127.0.0.1:1/", "user name or password"),
        ("http://169.254.169.254/latest/meta-data/", "without a path"),
        ("http://169.254.169.254:9000", "metadata"),
        ("http://[::ffff:169.254.169.254]:9000", "IPv4 169.254.169.254"),
        ("http://[fe80::1]:9000", "link-local"),
        ("http://[::1]:1/", "Port 1"),
        ("http://8.8.8.8:9000", "not in BATON_AGENT_NETWORKS"),
    ],
)
def test_a_refusal_says_why(url, words):
    with pytest.raises(ValidationError) as caught:
        check_agent_endpoint(url)
    assert words in " ".join(caught.value.messages)


def test_ipv4_mapped_metadata_is_checked_as_ipv4(settings):
    for url in ("http://[::ffff:169.254.169.254]:9000", "http://[::ffff:a9fe:a9fe]:9000"):
        with pytest.raises(ValidationError) as caught:
            check_agent_endpoint(url)
        assert caught.value.code == "address"
        assert "metadata" in caught.value.messages[0]
    # Allowing every IPv6 address does not let IPv4 through in disguise.
    settings.BATON_AGENT_NETWORKS = ["::/0"]
    with pytest.raises(ValidationError, match="not in BATON_AGENT_NETWORKS"):
        check_agent_endpoint("http://[::ffff:8.8.8.8]:9000")


def test_metadata_and_link_local_are_refused_whatever_the_networks_say(settings):
    settings.BATON_AGENT_NETWORKS = ["0.0.0.0/0", "::/0"]
    assert check_agent_endpoint("http://8.8.8.8:9000") == "http://8.8.8.8:9000"
    for url in (
        "http://169.254.169.254:9000",
        "http://169.254.1.1:9000",
        "http://[fd00:ec2::254]:9000",
        "http://100.100.100.200:9000",
        "http://[::ffff:169.254.169.254]:9000",
        "http://[64:ff9b::a9fe:a9fe]:9000",
        "http://0.0.0.0:9000",
        "http://224.0.0.1:9000",
    ):
        with pytest.raises(ValidationError):
            check_agent_endpoint(url)


def test_every_resolved_address_is_checked(monkeypatch):
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        fake_dns({"agent.example": ["10.0.0.5", "169.254.169.254"], "ok.example": ["10.0.0.6"]}),
    )
    with pytest.raises(ValidationError) as caught:
        check_agent_endpoint("http://agent.example:9000")
    assert "'agent.example' resolves to 169.254.169.254" in caught.value.messages[0]
    assert check_agent_endpoint("http://OK.example:9000/") == "http://ok.example:9000"


def test_a_name_that_does_not_resolve_is_refused(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({}))
    with pytest.raises(ValidationError) as caught:
        check_agent_endpoint("http://ghost.example:9000")
    assert caught.value.code == "unresolvable"
    assert "Could not resolve 'ghost.example'" in caught.value.messages[0]


def test_a_hanging_resolver_costs_at_most_the_timeout(monkeypatch):
    import threading

    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(5)
        raise socket.gaierror("late")

    monkeypatch.setattr(socket, "getaddrinfo", hang)
    monkeypatch.setattr(endpoints, "RESOLVE_TIMEOUT_S", 0.05)
    try:
        with pytest.raises(ValidationError) as caught:
            check_agent_endpoint("http://slow.example:9000")
    finally:
        release.set()
    assert caught.value.code == "unresolvable"
    assert "no DNS answer" in caught.value.messages[0]


def test_a_bad_cidr_in_the_setting_is_improperly_configured(settings):
    settings.BATON_AGENT_NETWORKS = ["10.0.0.0/8", "10.0.0.0/33"]
    with pytest.raises(ImproperlyConfigured, match="'10.0.0.0/33'"):
        check_agent_endpoint("http://10.0.0.5:9000")
    errors = [e for e in run_checks() if e.id == "fleet.E001"]
    assert len(errors) == 1 and "10.0.0.0/33" in errors[0].msg


def test_the_networks_setting_narrows_what_is_allowed(settings):
    settings.BATON_AGENT_NETWORKS = ["10.20.0.0/16"]
    assert check_agent_endpoint("http://10.20.1.2:9000") == "http://10.20.1.2:9000"
    with pytest.raises(ValidationError, match=r"not in BATON_AGENT_NETWORKS \(10\.20\.0\.0/16\)"):
        check_agent_endpoint("http://127.0.0.1:9000")


# --- registration and operator edits --------------------------------------------------------


@pytest.mark.parametrize("url", REFUSED)
def test_registration_refuses_with_400_naming_the_field(registered_a, token_a, url):
    before = snapshot(registered_a)
    response = register(token_a, url)
    assert response.status_code == 400
    body = response.json()
    assert list(body) == ["endpoint"] and body["endpoint"][0]
    assert snapshot(registered_a) == before
    assert not FleetEvent.objects.filter(node=registered_a, message__contains=url).exists()


@pytest.mark.parametrize("url", REFUSED)
def test_an_operators_edit_refuses_with_400_naming_the_field(operator, registered_a, url):
    before = snapshot(registered_a)
    response = operator.patch(
        f"/api/v1/nodes/{registered_a.pk}/", {"agent_endpoint": url}, format="json"
    )
    assert response.status_code == 400
    assert "agent_endpoint" in response.json()
    assert snapshot(registered_a) == before


def test_creating_a_node_with_a_refused_endpoint_is_400(operator, dc_a, gpu_a):
    response = operator.post(
        "/api/v1/nodes/",
        {
            "hostname": "n-1",
            "datacenter": dc_a.id,
            "gpu_type": gpu_a.id,
            "gpu_count": 2,
            "agent_endpoint": "http://169.254.169.254:9000",
        },
        format="json",
    )
    assert response.status_code == 400
    assert "metadata" in response.json()["agent_endpoint"][0]
    assert not Node.objects.filter(hostname="n-1").exists()


def test_a_loopback_endpoint_registers_normalised(node_a, token_a):
    response = register(token_a, "HTTP://127.0.0.1:9101/")
    assert response.status_code == 200, response.json()
    node_a.refresh_from_db()
    assert node_a.agent_endpoint == "http://127.0.0.1:9101"


def test_a_name_resolving_to_a_refused_address_is_refused_at_register_and_edit(
    monkeypatch, operator, registered_a, token_a
):
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        fake_dns(
            {"meta.example": ["10.0.0.7", "::ffff:169.254.169.254"], "a.example": ["10.0.0.8"]}
        ),
    )
    before = snapshot(registered_a)
    response = register(token_a, "http://meta.example:9000")
    assert response.status_code == 400
    assert "169.254.169.254" in response.json()["endpoint"][0]
    response = operator.patch(
        f"/api/v1/nodes/{registered_a.pk}/",
        {"agent_endpoint": "http://meta.example:9000"},
        format="json",
    )
    assert response.status_code == 400 and "agent_endpoint" in response.json()
    assert snapshot(registered_a) == before
    response = register(token_a, "http://a.example:9000")
    assert response.status_code == 200, response.json()
    registered_a.refresh_from_db()
    assert registered_a.agent_endpoint == "http://a.example:9000"


def test_a_name_that_does_not_resolve_is_a_400_at_register(monkeypatch, registered_a, token_a):
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({}))
    response = register(token_a, "http://ghost.example:9000")
    assert response.status_code == 400
    assert "Could not resolve" in response.json()["endpoint"][0]


def test_an_allowed_edit_is_stored_normalised(operator, registered_a):
    response = operator.patch(
        f"/api/v1/nodes/{registered_a.pk}/",
        {"agent_endpoint": "HTTP://10.0.0.9:9000/"},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["agent_endpoint"] == "http://10.0.0.9:9000"


def test_model_validation_refuses_a_changed_endpoint(node_a):
    # The admin's forms and the services go through full_clean().
    node = Node.objects.get(pk=node_a.pk)
    node.agent_endpoint = "http://169.254.169.254:9000"
    with pytest.raises(ValidationError) as caught:
        node.full_clean()
    assert "agent_endpoint" in caught.value.message_dict


def test_editing_another_field_does_not_recheck_an_unchanged_endpoint(operator, node_a):
    Node.objects.filter(pk=node_a.pk).update(agent_endpoint="http://ghost.invalid:9000")
    response = operator.patch(f"/api/v1/nodes/{node_a.pk}/", {"gpu_count": 4}, format="json")
    assert response.status_code == 200, response.json()


# --- KV endpoints in heartbeats -------------------------------------------------------------


def instance_report(kv_endpoint) -> dict:
    return {"instance_id": "1", "role": "prefill", "state": "running", "kv_endpoint": kv_endpoint}


@pytest.mark.parametrize(
    ("kv_endpoint", "field"),
    [
        ({"host": "169.254.169.254", "port": 9301, "wan_port": 9302}, "host"),
        ({"host": "::ffff:169.254.169.254", "port": 9301}, "host"),
        ({"host": "8.8.8.8", "port": 9301}, "host"),
        ({"host": "127.0.0.1", "port": 22}, "port"),
        ({"host": "127.0.0.1", "port": 9301, "wan_port": 25}, "wan_port"),
        ({"host": "127.0.0.1", "port": "x"}, "port"),
        ({"port": 9301}, "host"),
    ],
)
def test_a_heartbeat_with_a_refused_kv_endpoint_is_400(registered_a, token_a, kv_endpoint, field):
    body = {"node": "a-1", "instances": [instance_report(kv_endpoint)]}
    response = agent_api(token_a).post("/api/v1/agent/heartbeat", body, format="json")
    assert response.status_code == 400
    assert field in response.json()["instances"][0]["kv_endpoint"]


@pytest.mark.parametrize(
    "kv_endpoint", [{"host": "127.0.0.1", "port": 9301, "wan_port": 9302}, None]
)
def test_a_heartbeat_with_an_allowed_kv_endpoint_is_taken(registered_a, token_a, kv_endpoint):
    body = {"node": "a-1", "instances": [instance_report(kv_endpoint)]}
    response = agent_api(token_a).post("/api/v1/agent/heartbeat", body, format="json")
    assert response.status_code == 200, response.json()


def test_registration_checks_the_kv_endpoints_too(node_a, token_a):
    kv = {"host": "169.254.169.254", "port": 9301}
    response = register(token_a, "http://10.0.0.5:9000", [instance_report(kv)])
    assert response.status_code == 400
    assert "host" in response.json()["instances"][0]["kv_endpoint"]


# --- the client, before every call ----------------------------------------------------------


def recording(answer=None):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request) if answer else httpx.Response(200, json={"instances": []})

    return seen, httpx.MockTransport(handler)


def test_the_client_refuses_an_endpoint_that_became_refused(registered_a, settings):
    seen, transport = recording()
    with AgentClient(registered_a, transport=transport) as client:
        client.state()
        settings.BATON_AGENT_NETWORKS = ["192.168.0.0/16"]
        with pytest.raises(AgentEndpointRefused, match="not in BATON_AGENT_NETWORKS"):
            client.start_instance(instance_id=3, role="prefill", model="m", source="m")
    assert len(seen) == 1  # the refused call sent nothing, so no command token either
    assert seen[0].headers["authorization"] == f"Bearer {registered_a.command_token}"
    assert not issubclass(AgentEndpointRefused, AgentUnreachable)  # tasks do not retry it


def test_a_refused_row_is_never_called(registered_a):
    # A row stored before the policy existed (or written around it).
    Node.objects.filter(pk=registered_a.pk).update(agent_endpoint="http://169.254.169.254:80")
    registered_a.refresh_from_db()
    seen, transport = recording()
    with (
        AgentClient(registered_a, transport=transport) as client,
        pytest.raises(AgentEndpointRefused, match="metadata"),
    ):
        client.state()
    assert seen == []


def test_the_client_re_resolves_before_every_call_and_connects_to_the_checked_address(
    node_a, token_a, monkeypatch
):
    answers = {"agent.example": ["10.0.0.5"]}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(answers))
    assert register(token_a, "http://agent.example:9000").status_code == 200
    node_a.refresh_from_db()
    seen, transport = recording()
    with AgentClient(node_a, transport=transport) as client:
        client.state()
        answers["agent.example"] = ["169.254.169.254"]  # DNS rebinding after registration
        with pytest.raises(AgentEndpointRefused, match="resolves to 169.254.169.254"):
            client.stop_instance(instance_id=3)
        answers.clear()
        with pytest.raises(AgentEndpointUnresolvable) as caught:
            client.state()
    assert isinstance(caught.value, AgentUnreachable)  # a DNS failure is retried like one
    (request,) = seen
    assert request.url == "http://10.0.0.5:9000/state"
    assert request.headers["host"] == "agent.example:9000"


def test_an_https_name_keeps_its_sni(node_a, monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"agent.example": ["10.0.0.5"]}))
    Node.objects.filter(pk=node_a.pk).update(
        agent_endpoint="https://agent.example", registered_at=timezone.now(), command_token="t"
    )
    node_a.refresh_from_db()
    seen, transport = recording()
    with AgentClient(node_a, transport=transport) as client:
        client.state()
    assert (seen[0].url.scheme, seen[0].url.host, seen[0].url.path) == (
        "https",
        "10.0.0.5",
        "/state",
    )
    assert seen[0].headers["host"] == "agent.example"
    assert seen[0].extensions["sni_hostname"] == "agent.example"


def test_a_redirect_from_the_agent_is_not_followed(registered_a):
    seen, transport = recording(
        lambda request: httpx.Response(
            302, headers={"Location": "http://169.254.169.254/latest/meta-data/"}
        )
    )
    with AgentClient(registered_a, transport=transport) as client:
        assert client._http.follow_redirects is False
        with pytest.raises(AgentError, match="agent answered a redirect") as caught:
            client.state()
    assert not isinstance(caught.value, AgentUnreachable)
    assert [str(r.url) for r in seen] == ["http://10.0.0.5:9000/state"]


# --- what the control plane does with a refused endpoint ------------------------------------


@pytest.fixture
def refused_online(registered_a, settings) -> Node:
    Node.objects.filter(pk=registered_a.pk).update(status=NodeStatus.ONLINE)
    registered_a.refresh_from_db()
    settings.BATON_AGENT_NETWORKS = ["192.168.0.0/16"]
    return registered_a


def test_reconcile_of_a_refused_endpoint_is_one_event_not_an_error(
    refused_online, prefill_a, caplog
):
    with caplog.at_level("WARNING", logger="fleet.agent_services"):
        assert agent_services.node_reconcile(node=refused_online) == []
        assert agent_services.node_reconcile(node=refused_online) == []  # the next round
    events = FleetEvent.objects.filter(node=refused_online, kind="node.endpoint_refused")
    assert events.count() == 1
    assert "not in BATON_AGENT_NETWORKS" in events.get().message
    assert len([r for r in caplog.records if "endpoint refused" in r.getMessage()]) == 1


def test_the_reconcile_task_does_not_raise_or_retry(refused_online, prefill_a):
    from fleet import tasks

    assert tasks.reconcile_node.apply(args=(refused_online.pk,)).get() == []


def test_a_link_push_skips_a_refused_node_and_reaches_the_others(
    refused_online, node_b, link_ab, monkeypatch
):
    Node.objects.filter(pk=node_b.pk).update(
        agent_endpoint="http://192.168.1.5:9000",
        registered_at=timezone.now(),
        command_token="b-token",
        status=NodeStatus.ONLINE,
    )
    seen, transport = recording(lambda request: httpx.Response(200, json={}))
    monkeypatch.setattr(
        agent_services, "AgentClient", lambda node: AgentClient(node, transport=transport)
    )
    assert agent_services.link_push(link=WANLink.objects.get(pk=link_ab.pk)) == ["b-1"]
    assert [r.url.host for r in seen] == ["192.168.1.5"]
    assert FleetEvent.objects.filter(node=refused_online, kind="node.endpoint_refused").exists()


# --- the data check of existing rows --------------------------------------------------------


def test_the_system_check_warns_about_stored_endpoints_the_policy_refuses(node_a, node_b):
    Node.objects.filter(pk=node_a.pk).update(agent_endpoint="http://169.254.169.254:80")
    Node.objects.filter(pk=node_b.pk).update(agent_endpoint="http://10.0.0.5:9000")
    warnings = [w for w in run_checks(databases=["default"]) if w.id == "fleet.W001"]
    assert len(warnings) == 1
    assert "a-1" in warnings[0].msg and "metadata" in warnings[0].msg
    # Without a database named (plain `manage.py check`) it reads nothing.
    assert not [w for w in run_checks() if w.id == "fleet.W001"]
