"""Scenario files: named what-if experiments as data, each parameter with its source beside it.

A scenario is JSON under ``planner/scenarios/``: an optional ``include`` of shared defaults,
a ``base`` (fleet, workload, SLA), and ``cases`` that override the base by deep merge. Keys
starting with ``_`` (``_source``, ``_note``) document the value next to them and are ignored.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCENARIO_DIR = Path(__file__).parent / "scenarios"
KINDS = ("fleet", "transfer")


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; mappings merge, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating levels as needed."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"sweep.path: {dotted!r} crosses a non-object at {key!r}")
    node[leaf] = value


def list_scenarios() -> list[tuple[str, str]]:
    """(name, description) of every bundled scenario."""
    out = []
    for path in sorted(SCENARIO_DIR.glob("*.json")):
        if path.name.startswith("_"):
            continue
        data = json.loads(path.read_text())
        out.append((path.stem, str(data.get("description", ""))))
    return out


# What a scenario file may hold at its top level ("_"-prefixed keys are comments).
TOP_LEVEL_KEYS = frozenset(
    {"name", "description", "include", "kind", "base", "cases", "sweep", "search_space"}
)


def load_scenario(name_or_path: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Load a scenario by bundled name, by file path, or accept an already-parsed dict.

    Resolves ``include`` and validates the top-level shape; raises ValueError on bad input.
    """
    if isinstance(name_or_path, Mapping):
        data = copy.deepcopy(dict(name_or_path))
        where = str(data.get("name", "scenario"))
        base_dir = SCENARIO_DIR
    else:
        path = Path(name_or_path)
        if not path.suffix:
            path = SCENARIO_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(f"{name_or_path}: no such scenario (try `python -m planner list`)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
        where = path.name
        base_dir = path.parent
        data.setdefault("name", path.stem)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a scenario must be a JSON object")
    include = data.pop("include", None)
    if include is not None:
        inc_path = base_dir / include
        if not inc_path.exists():
            inc_path = SCENARIO_DIR / include
        if not inc_path.exists():
            raise ValueError(f"{where}: include {include!r} not found")
        included = json.loads(inc_path.read_text())
        if "base" in included or "cases" in included:
            # Including a whole scenario: inherit its cases and (resolved) base, then override.
            parent = load_scenario(inc_path)
            parent.pop("name", None)
            parent.pop("description", None)
            data = deep_merge(parent, data)
        else:
            data = deep_merge({"base": included}, data)
    unknown = sorted(k for k in data if k not in TOP_LEVEL_KEYS and not str(k).startswith("_"))
    if unknown:
        raise ValueError(
            f"{where}: unknown top-level key(s) {', '.join(map(repr, unknown))}; settings of a run "
            f"(workload, fleet, trace_file, ...) go under base or a case"
        )
    kind = data.setdefault("kind", "fleet")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    for key in ("base", "cases"):
        if not isinstance(data.get(key, {}), Mapping):
            raise ValueError(f"{where}.{key}: must be an object")
    data.setdefault("base", {})
    data.setdefault("cases", {"default": {}})
    return data


def case_configs(scenario: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The fully merged configuration of each case, comments kept.

    A case set to ``null`` is dropped (a scenario that includes another can remove its cases).
    """
    return {
        name: deep_merge(scenario["base"], override)
        for name, override in scenario["cases"].items()
        if not name.startswith("_") and override is not None
    }
