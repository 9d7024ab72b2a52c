"""The gateway's request path is a line: each step's module imports none of the other steps,
the steps write their records only through the record service (`recorder.py`), and
`views.py` composes them, calling each once, in order (routing/gateway/README.md)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[3] / "routing" / "gateway"
STEPS = ["admission", "routes", "recorder", "run", "views"]
MODULES = [*STEPS, "records"]


def _tree(name: str) -> ast.Module:
    return ast.parse((GATEWAY / f"{name}.py").read_text())


def _imports(name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("routing.gateway."):
                found.add(node.module.rsplit(".", 1)[1])
            elif node.module == "routing.gateway":
                found.update(a.name for a in node.names)
    return found & set(MODULES)


def test_each_step_imports_no_other_step_but_views_composes_them():
    assert _imports("admission") == set()  # refusals are raised, never recorded here
    assert _imports("routes") == set()  # so is no healthy path; the run notes new attempts
    assert _imports("recorder") == {"records"}  # the service over the rows
    assert _imports("run") == {"recorder"}
    assert _imports("views") == {"admission", "routes", "recorder", "run"}


def test_steps_one_to_three_are_called_once_each_in_order():
    (admit,) = [
        node
        for node in ast.walk(_tree("views"))
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "_admit"
    ]
    calls = sorted(
        (node.lineno, node.col_offset, f"{node.func.value.id}.{node.func.attr}")
        for node in ast.walk(admit)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in STEPS
    )
    steps = [call for _, _, call in calls]
    # recorder.rejected: the refusal's record, instead of the admission
    assert steps == [
        "admission.admit",
        "routes.route_first",
        "recorder.admitted",
        "recorder.rejected",
    ]
