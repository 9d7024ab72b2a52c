"""System checks of the fleet app (``manage.py check``; ``migrate`` runs them too).

- ``fleet.E001``: ``BATON_AGENT_NETWORKS`` holds something that is not a CIDR network.
- ``fleet.W001``: a node's stored ``agent_endpoint`` is one the agent endpoint policy
  (fleet.endpoints) now refuses, e.g. a row from before the policy existed. The control plane
  no longer calls such a node (each attempt is a ``node.endpoint_refused`` event); fix it by
  restarting the agent with an allowed ``--listen`` / ``--advertise-url`` (it registers again)
  or by editing the node's endpoint. This one reads the database, so it runs only when a
  database is named: ``manage.py check --database default`` (and during ``migrate``).
"""

from __future__ import annotations

from django.core.checks import Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import DatabaseError


@register("fleet")
def agent_networks_check(app_configs=None, **kwargs):
    from fleet.endpoints import allowed_networks

    try:
        allowed_networks()
    except ImproperlyConfigured as exc:
        return [
            Error(
                str(exc),
                hint="A comma-separated list of CIDRs, e.g. 10.0.0.0/8,fc00::/7.",
                id="fleet.E001",
            )
        ]
    return []


@register("fleet", Tags.database)
def agent_endpoints_check(app_configs=None, databases=None, **kwargs):
    if not databases:
        return []
    from fleet.endpoints import allowed_networks, check_agent_endpoint
    from fleet.models import Node

    try:
        allowed_networks()
    except ImproperlyConfigured:
        return []  # fleet.E001 says so; every endpoint would fail the same way
    warnings = []
    for alias in databases:
        try:
            rows = list(
                Node.objects.using(alias)
                .exclude(agent_endpoint="")
                .order_by("hostname")
                .values_list("hostname", "agent_endpoint")
            )
        except DatabaseError:
            continue  # not migrated yet: no rows to check
        for hostname, endpoint in rows:
            try:
                check_agent_endpoint(endpoint)
            except ValidationError as exc:
                warnings.append(
                    Warning(
                        f"Node {hostname}: agent endpoint {endpoint} is refused by the agent "
                        f"endpoint policy: {' '.join(exc.messages)}",
                        hint="The control plane will not call this agent. Restart the agent "
                        "with an allowed --listen or --advertise-url (it registers again), "
                        "edit the node's agent_endpoint, or, if the address is right, add its "
                        "network to BATON_AGENT_NETWORKS (docs/security.md).",
                        obj=f"node {hostname}",
                        id="fleet.W001",
                    )
                )
    return warnings
