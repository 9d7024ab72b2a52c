"""Which addresses the control plane (and the agents it points at each other) may connect to.

An agent endpoint comes from the agent itself (``POST /api/v1/agent/register``) or from an
operator (``agent_endpoint`` of a node), and the control plane then calls it with the node's
command token, and the gateway with the data-plane token. So an endpoint is checked here at
registration, at an operator's edit and again before every call (the name is resolved afresh
each time, so a DNS answer that changes after registration is caught):

- the scheme is ``http`` or ``https``; no user name or password (``user:pw@``); a host; the port
  is explicit or the scheme's default, and below 1024 only 80 or 443 (the other privileged
  ports are system services: ssh, smtp, dns...); no path other than empty or ``/`` (a longer
  path is refused, not stripped: ``http://10.0.0.5:9000/v1`` most likely means a mistake), no
  query, no fragment. The normalised form is ``scheme://host[:port]``, lowercase, without the
  trailing slash;
- the host is an IP literal or a DNS name; a name is resolved (``socket.getaddrinfo``, at most
  ``RESOLVE_TIMEOUT_S``) and EVERY address it resolves to is checked;
- an IPv4-mapped IPv6 address (``::ffff:169.254.169.254``) is checked as the IPv4 address it is;
  a NAT64 one (``64:ff9b::/96``) is refused if the IPv4 address it embeds is;
- whatever ``BATON_AGENT_NETWORKS`` says, link-local (169.254.0.0/16, fe80::/10), the cloud
  metadata and host services below, unspecified (0.0.0.0/8, ::), multicast, broadcast and
  reserved (240.0.0.0/4) addresses are refused;
- then the address must lie in one of the networks of ``settings.BATON_AGENT_NETWORKS``.

Every failure is a Django ``ValidationError`` whose message says what is wrong; its ``code``
tells the kinds apart (``unresolvable`` is the one a later retry may cure).

A call then connects to the address that was checked (``AgentTarget.request_parts``; the
gateway's transports with a short cache of the answers: fleet.pinning).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

RESOLVE_TIMEOUT_S = 2.0
SCHEMES = {"http": 80, "https": 443}
# Below 1024 only these: the privileged ports are system services, never an agent.
WELL_KNOWN_AGENT_PORTS = frozenset(SCHEMES.values())

# Refused whatever BATON_AGENT_NETWORKS says: (network, why). Most specific first, so the
# message names the metadata service rather than the link-local range it lies in.
_NEVER: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(cidr), why)
    for cidr, why in (
        ("169.254.169.254/32", "the cloud instance metadata service (AWS, GCP, Azure, ...)"),
        ("169.254.170.2/32", "the AWS ECS task metadata endpoint"),
        ("169.254.170.23/32", "the AWS EKS Pod Identity agent"),
        ("fd00:ec2::/32", "AWS's IPv6 instance services (metadata fd00:ec2::254, DNS, NTP)"),
        ("fd20:ce::254/128", "the GCP metadata server (IPv6)"),
        ("100.100.100.200/32", "the Alibaba Cloud metadata service"),
        ("192.0.0.192/32", "the Oracle Cloud (classic) metadata service"),
        ("168.63.129.16/32", "the Azure host service (WireServer)"),
        ("169.254.0.0/16", "a link-local address"),
        ("fe80::/10", "a link-local address"),
        ("0.0.0.0/8", "an unspecified ('this network') address"),
        ("::/128", "the unspecified address"),
        ("255.255.255.255/32", "the broadcast address"),
        ("224.0.0.0/4", "a multicast address"),
        ("ff00::/8", "a multicast address"),
        ("240.0.0.0/4", "a reserved address"),
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

_HOSTNAME = re.compile(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)
# inet_aton-style numbers (2130706433, 0x7f.1, 017700000001): resolvers turn them into
# addresses, so they are either canonical IP literals or refused.
_NUMERIC_LABELS = re.compile(r"^((0x[0-9a-f]*|[0-9]+)\.?)+$")


@dataclass(frozen=True, slots=True)
class AgentTarget:
    """A checked endpoint: its normalised URL and the addresses it resolved to just now."""

    url: str  # scheme://host[:port], no trailing slash
    scheme: str
    host: str  # lowercase name, or the IP literal (IPv6 without brackets)
    port: int  # explicit or the scheme's default
    authority: str  # host[:port] as written in the URL (IPv6 in brackets): the Host header
    addresses: tuple[IPAddress, ...]
    is_ip_literal: bool

    def pinned_url(self, path: str = "") -> str:
        """``path`` on the first checked address, so the connection goes where the check
        looked (no second lookup that a rebinding DNS server could answer differently)."""
        address = self.addresses[0]
        host = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{host}:{self.port}{path}"

    def request_parts(self, path: str = "") -> tuple[str, dict[str, str], dict[str, str]]:
        """How to call ``path`` here: (URL, headers, httpx request extensions). A name: the
        pinned URL, with the name as ``Host`` and, for https, as the TLS server name (SNI, also
        the name the certificate is verified against). An IP literal: its own URL, as is."""
        if self.is_ip_literal:
            return self.url + path, {}, {}
        extensions = {"sni_hostname": self.host} if self.scheme == "https" else {}
        return self.pinned_url(path), {"Host": self.authority}, extensions


# --- the allowed networks -------------------------------------------------------------------

_networks_cache: tuple[tuple[str, ...], tuple[IPNetwork, ...]] | None = None


def allowed_networks() -> tuple[IPNetwork, ...]:
    """``settings.BATON_AGENT_NETWORKS`` parsed; ImproperlyConfigured naming a bad entry."""
    global _networks_cache
    raw = settings.BATON_AGENT_NETWORKS
    if isinstance(raw, str):
        raw = raw.split(",")
    key = tuple(str(item).strip() for item in raw)
    if _networks_cache is not None and _networks_cache[0] == key:
        return _networks_cache[1]
    networks = []
    for cidr in key:
        if not cidr:
            continue
        try:
            networks.append(ipaddress.ip_network(cidr, strict=False))
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"BATON_AGENT_NETWORKS: {cidr!r} is not a network in CIDR notation "
                f"(e.g. 10.0.0.0/8 or fc00::/7): {exc}"
            ) from None
    _networks_cache = (key, tuple(networks))
    return _networks_cache[1]


def _networks_text(networks: Iterable[IPNetwork]) -> str:
    return ", ".join(str(n) for n in networks) or "none"


# --- addresses ------------------------------------------------------------------------------


def _effective(address: IPAddress) -> IPAddress:
    """What a connection to `address` reaches: an IPv4-mapped IPv6 address is its IPv4."""
    if address.version == 6 and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def address_refusal(address: IPAddress) -> str | None:
    """Why the policy refuses `address` (a sentence fragment), or None if it is allowed."""
    address = _effective(address)
    candidates = [address]
    if address.version == 6 and address in _NAT64:
        candidates.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    for candidate in candidates:
        for network, why in _NEVER:
            if candidate.version == network.version and candidate in network:
                return f"{why}, which agent endpoints may never be"
    networks = allowed_networks()
    if not any(address.version == n.version and address in n for n in networks):
        return f"not in BATON_AGENT_NETWORKS ({_networks_text(networks)})"
    return None


def _resolve(host: str, port: int) -> tuple[IPAddress, ...]:
    """All addresses `host` resolves to, looked up in a daemon thread so that a resolver that
    hangs costs at most RESOLVE_TIMEOUT_S (getaddrinfo itself has no timeout)."""
    # Filled by the lookup thread: getaddrinfo's answer, or the error it raised.
    infos: list[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple]] = []
    errors: list[OSError | UnicodeError] = []

    def lookup() -> None:
        try:
            infos.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=lookup, name=f"resolve {host}", daemon=True)
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    if thread.is_alive():
        raise ValidationError(
            f"Could not resolve {host!r}: no DNS answer within {RESOLVE_TIMEOUT_S:g} s.",
            code="unresolvable",
        )
    if errors:
        raise ValidationError(f"Could not resolve {host!r}: {errors[0]}.", code="unresolvable")
    found: list[IPAddress] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        except ValueError:
            continue
        if address not in found:
            found.append(address)
    if not found:
        raise ValidationError(
            f"Could not resolve {host!r}: no IPv4 or IPv6 address.", code="unresolvable"
        )
    return tuple(found)


def _parse_host(host: str) -> tuple[str, IPAddress | None]:
    """(normalised host, its address when it is an IP literal); ValidationError otherwise."""
    if "%" in host:
        raise ValidationError(
            f"The host {host!r} carries an IPv6 zone id; use an address without one.",
            code="host",
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        return str(address), address
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    if _NUMERIC_LABELS.match(name):
        raise ValidationError(
            f"The host {host!r} is not a valid IP address; write IPv4 addresses as four "
            "decimal numbers (e.g. 10.0.0.5).",
            code="host",
        )
    if len(name) > 253 or not _HOSTNAME.match(name):
        raise ValidationError(
            f"The host {host!r} is neither an IP address nor a valid DNS name.", code="host"
        )
    return name, None


def check_agent_port(port: int) -> int:
    """1-65535, and below 1024 only 80 or 443; ValidationError (code ``port``) otherwise."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValidationError(f"The port must be 1-65535, not {port!r}.", code="port")
    if port < 1024 and port not in WELL_KNOWN_AGENT_PORTS:
        raise ValidationError(
            f"Port {port} belongs to a system service (ssh, smtp, dns, ...); an agent serves on "
            "80, 443 or a port from 1024 up.",
            code="port",
        )
    return port


def check_agent_address(host: str, port: int) -> tuple[str, tuple[IPAddress, ...]]:
    """Check a host and port an agent or the control plane would connect to (a KV fabric
    address, say): (normalised host, the addresses checked). ValidationError if refused."""
    if not isinstance(host, str) or not host:
        raise ValidationError("A host is required.", code="host")
    check_agent_port(port)
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    name, literal = _parse_host(host)
    addresses = (literal,) if literal is not None else _resolve(name, port)
    for address in addresses:
        why = address_refusal(address)
        if why is not None:
            shown = str(address) if literal is not None else f"{name!r} resolves to {address}"
            if _effective(address) != address:
                shown += f" (IPv4 {_effective(address)})"
            raise ValidationError(f"Refused: {shown} is {why}.", code="address")
    return name, addresses


# --- endpoints ------------------------------------------------------------------------------


def resolve_agent_endpoint(url: str) -> AgentTarget:
    """Check an agent endpoint URL now (resolving its name afresh) and return what was checked.

    Raises ValidationError with a message naming the problem; code ``unresolvable`` when the
    name did not resolve (possibly a passing DNS failure), another code when it is refused.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValidationError("An agent endpoint URL is required.", code="required")
    url = url.strip()
    if any(ch.isspace() or ord(ch) < 0x20 or ch == "\\" for ch in url):
        raise ValidationError(
            "The URL contains whitespace, control characters or backslashes.", code="invalid"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValidationError(f"Not a valid URL: {exc}.", code="invalid") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        shown = f"'{parts.scheme}'" if parts.scheme else "none"
        raise ValidationError(
            f"Use an http:// or https:// URL (scheme {shown} is not allowed).", code="scheme"
        )
    if "@" in parts.netloc:
        raise ValidationError(
            "An agent endpoint may not carry a user name or password ('user:pw@').",
            code="userinfo",
        )
    host = parts.hostname
    if not host:
        raise ValidationError("The URL names no host.", code="host")
    if parts.path not in ("", "/"):
        raise ValidationError(
            f"An agent endpoint is a base URL (scheme://host:port) without a path; "
            f"remove {parts.path!r}.",
            code="path",
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValidationError("An agent endpoint has no query string or fragment.", code="path")
    try:
        explicit_port = parts.port
    except ValueError:
        raise ValidationError("The port must be a number from 1 to 65535.", code="port") from None
    if explicit_port == 0 or (explicit_port is None and parts.netloc.endswith(":")):
        raise ValidationError("The port must be a number from 1 to 65535.", code="port")
    port = explicit_port or SCHEMES[scheme]
    name, addresses = check_agent_address(host, port)
    shown_host = f"[{name}]" if ":" in name else name
    authority = shown_host if explicit_port is None else f"{shown_host}:{explicit_port}"
    return AgentTarget(
        url=f"{scheme}://{authority}",
        scheme=scheme,
        host=name,
        port=port,
        authority=authority,
        addresses=addresses,
        is_ip_literal=_is_ip(name),
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_agent_endpoint(url: str) -> str:
    """The normalised form of an allowed agent endpoint (``scheme://host[:port]``, lowercase,
    no trailing slash); ValidationError saying why otherwise."""
    return resolve_agent_endpoint(url).url
