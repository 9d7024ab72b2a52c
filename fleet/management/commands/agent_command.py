"""Print the command line that starts a node's agent, bound to this control plane.

The token never goes into the agent's arguments (every local user sees those in ``ps``): the
line sets ``BATON_AGENT_TOKEN`` for the agent (a shell assignment, not an argument), or, with
``--token-file``, the token is written to a file only its owner can read and the line names it.
"""

from __future__ import annotations

import os
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
        parser.add_argument(
            "--token-file",
            default="",
            help="Write the token to this file (mode 0600) and have the line read it from there.",
        )

    def handle(
        self,
        *args,
        node: str,
        control_plane: str,
        listen: str,
        python: str,
        token_file: str,
        **options,
    ):
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
        ]
        if token_file:
            try:
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(token + "\n")
                os.chmod(token_file, 0o600)
            except OSError as exc:
                raise CommandError(f"cannot write {token_file}: {exc.strerror}") from None
            text = shlex.join([*line, "--token-file", token_file])
        else:
            text = f"BATON_AGENT_TOKEN={shlex.quote(token)} {shlex.join(line)}"
        self.stderr.write(
            f"Issued a new agent token for {found.hostname}; the previous one no longer works."
        )
        self.stdout.write(text)
