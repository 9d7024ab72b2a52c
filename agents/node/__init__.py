"""The node agent process (`python -m agents serve`): hosts engine instances by role, serves the
HTTP API of agents/PROTOCOL.md, runs the PDD pipelines across agents, and the loopback check."""
