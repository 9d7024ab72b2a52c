"""Print the command line that starts a node's agent, bound to this control plane."""

from __future__ import annotations

import shlex
from urllib.parse import urlparse

from django.core.management.base import BaseCommand, CommandError

from fleet import services
from fleet.models import Node


class Command(BaseCommand):
    help = (
        "Print the exact `python -m agents serve ...` line for a node. Agent tokens are stored "
        "hashed, so this issues a fresh token: the node's previous token stops working."
    )

    def add_arguments(self, parser):
        parser.add_argument("node", help="The node's hostname or id.")
        parser.add_argument(
            "--control-plane",
            default="http://127.0.0.1:8000",
            help="URL the agent reaches the control plane at (default %(default)s).",
        )
        parser.add_argument(
            "--listen",
            default="",
            help="host:port the agent serves on (default: from the node's agent_endpoint, "
            "else 0.0.0.0:9000).",
        )
        parser.add_argument("--python", default="python", help="Interpreter to put in the line.")

    def handle(self, *args, node: str, control_plane: str, listen: str, python: str, **options):
        found = Node.objects.filter(hostname=node).first()
        if found is None and node.isdigit():
            found = Node.objects.filter(pk=int(node)).first()
        if found is None:
            raise CommandError(f"no node with hostname or id {node!r}")
        if not urlparse(control_plane).scheme.startswith("http"):
            raise CommandError(f"--control-plane must be an http(s) URL, got {control_plane!r}")
        if not listen:
            parsed = urlparse(found.agent_endpoint) if found.agent_endpoint else None
            listen = (
                f"{parsed.hostname}:{parsed.port or 80}"
                if parsed and parsed.hostname
                else "0.0.0.0:9000"
            )
        token = services.node_rotate_token(node=found, actor="agent_command")
        line = [
            python,
            "-m",
            "agents",
            "serve",
            "--node",
            found.hostname,
            "--datacenter",
            found.datacenter.name,
            "--listen",
            listen,
            "--control-plane",
            control_plane.rstrip("/"),
            "--token",
            token,
        ]
        self.stderr.write(
            f"Issued a new agent token for {found.hostname}; the previous one no longer works."
        )
        self.stdout.write(shlex.join(line))
