"""`fleet/` has no import circle, with every import counted (also those inside functions): the
services queue tasks by their Celery names (fleet.dispatch), so none imports `fleet.tasks` (a
package importing its own submodules does not count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_BACK_EDGES: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    files = [p for p in (ROOT / "fleet").rglob("*.py") if "migrations" not in p.parts]
    names = {_module(p) for p in files}
    for path in files:
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges.update(t for t in targets if t in names)
        me = _module(path)
        # A package's __init__ re-exporting its own submodules is not a circle.
        graph[me] = {
            t
            for t in edges
            if t != me and not (path.name == "__init__.py" and t.startswith(me + "."))
        }
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if (node, nxt) in ALLOWED_BACK_EDGES:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_fleet_has_no_import_circle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])
