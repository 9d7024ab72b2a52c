"""The gateway's request path is a line: each step's module imports none of the steps after
it and none before it except through `views.py`, which composes them
(routing/gateway/README.md)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[3] / "routing" / "gateway"
STEPS = ["admission", "routes", "records", "run", "views"]


def _imports(name: str) -> set[str]:
    tree = ast.parse((GATEWAY / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("routing.gateway."):
                found.add(node.module.rsplit(".", 1)[1])
            elif node.module == "routing.gateway":
                found.update(a.name for a in node.names)
    return found & set(STEPS)


def test_each_step_imports_no_other_step_but_views_composes_them():
    for step in STEPS[:-1]:
        others = _imports(step) - {"records"}  # every step may write its records
        assert not others, f"{step}.py imports {sorted(others)}"
    assert {"admission", "routes", "run", "records"} <= _imports("views")
