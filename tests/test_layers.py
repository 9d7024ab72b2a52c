"""Imports only point down, no module imports itself back through others, and tests/ mirrors
the packages.

Every import of every module of the project's packages counts, also the ones inside functions
(a lazy import is still a dependency) and relative ones; a package's ``__init__`` importing its
own submodules is not a circle. docs/architecture.md ("Layers") explains the order below.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "pdd",
    "agents",
    "base",
    "controlplane",
    "fleet",
    "billing",
    "routing",
    "planner",
    "plans",
    "frontend",
    "bench",
)

# Lowest first: a module may import its own layer and the layers below it, never one above.
#   pdd            what every part shares (the policy, the hardware model): no Django, no torch
#   agents         node agents and their engines: pdd only, never Django
#   planner        simulator and capacity planner: pdd only, never Django nor a Django app
#                  (`size --from-db` runs `manage.py planner_fleet`, which `plans` provides)
#   base           the Django-side helpers every app builds on: env-driven settings helpers,
#                  the bounded filters, JSON safety, roles, the schema's error shapes, the
#                  abstract hashed-token model (operators' tokens, tenants' keys, agents' tokens)
#   fleet          inventory and provisioning
#   billing        tenants, keys, prices, usage (reads fleet's prices and GPUs)
#   routing        the gateway (admits through billing, routes over fleet with pdd.policy)
#   plans          plan runs over the database's fleet (fleet rows into the planner)
#   frontend       the operator UI and telemetry: reads every app
#   controlplane   the project, the top: settings, URLs, ASGI, websocket routes, pushes,
#                  middleware, the Celery app; nothing below imports it
#   bench          the demo, the testbed and the benchmarks: drive everything
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pdd", ("pdd",)),
    ("agents", ("agents",)),
    ("planner", ("planner",)),
    ("base", ("base",)),
    ("fleet", ("fleet",)),
    ("billing", ("billing",)),
    ("routing", ("routing",)),
    ("plans", ("plans",)),
    ("frontend", ("frontend",)),
    ("controlplane", ("controlplane",)),
    ("bench", ("bench",)),
)
# The control plane runs without the agents' package or torch: only these import `agents`.
AGENTS_USERS = ("agents", "bench")
# Parts that import no Django (nor Channels, DRF or Celery, which need it).
DJANGO = ("django", "rest_framework", "drf_spectacular", "django_filters", "channels", "celery")
WITHOUT_DJANGO = ("pdd", "agents", "planner")
# The Django apps, the project and the apps' base: what the parts without Django never import.
DJANGO_APPS = ("base", "controlplane", "fleet", "billing", "routing", "plans", "frontend")
# The project package, which composes the apps; the apps and the base never import it (an app's
# Celery tasks are `celery.shared_task`s, bound to the project's Celery app at start-up).
PROJECT = "controlplane"
PROJECT_USERS = ("controlplane", "bench")
# Parts that import no torch (the control plane's packages among them).
TORCH_USERS = ("agents", "bench")


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[_module_name(path)] = path
    return found


def _from_base(node: ast.ImportFrom, path: Path, module: str) -> str:
    """The absolute module a ``from ... import`` reads from (a relative one made absolute)."""
    base = node.module or ""
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def _imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the file, relative ones made absolute."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, path, module)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


@cache
def _graph() -> dict[str, dict[str, int]]:
    """Module -> {project module it imports: line}; a package importing its own submodules
    is left out (that is how packages are built, not a circle)."""
    files = _files()
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for line, name in _imported_names(path, module):
            if name in files and name != module:
                if path.name == "__init__.py" and _is_under(name, module):
                    continue
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def _external(module: str) -> list[tuple[int, str]]:
    path = _files()[module]
    return [(line, name) for line, name in _imported_names(path, module) if name not in _files()]


def _layer(module: str) -> int:
    """The layer of a module: the layer of its package (the longest prefix that names one)."""
    best, best_len = None, -1
    for index, (_, members) in enumerate(LAYERS):
        for prefix in members:
            if _is_under(module, prefix) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS")
    return best


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
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


def test_every_module_is_in_a_layer():
    assert {_layer(m) for m in _graph()} <= set(range(len(LAYERS)))


def test_no_module_imports_itself_back_through_others():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_imports_only_point_down():
    up = [
        f"{_files()[src].relative_to(ROOT)}:{line} imports {dst} "
        f"({LAYERS[_layer(dst)][0]} is above {LAYERS[_layer(src)][0]})"
        for src, edges in sorted(_graph().items())
        for dst, line in sorted(edges.items())
        if _layer(dst) > _layer(src)
    ]
    assert not up, "\n".join(up)


def test_no_app_nor_the_base_imports_the_project_package():
    """`controlplane` is the top and only the top: the apps' shared helpers live in `base`, so
    no app (nor `base`, nor anything below) imports the project package, not even its Celery
    app or its package ``__init__``."""
    found = [
        f"{_files()[src].relative_to(ROOT)}:{line} imports {dst}"
        for src, edges in sorted(_graph().items())
        if not any(_is_under(src, p) for p in PROJECT_USERS)
        for dst, line in sorted(edges.items())
        if _is_under(dst, PROJECT)
    ]
    assert not found, "\n".join(found)


def test_the_base_is_no_django_app():
    """`base` holds helpers and abstract models only: no app config, no models module, no
    migrations, so it needs no place in INSTALLED_APPS and owns no table."""
    from django.conf import settings

    owned = sorted(
        str(p.relative_to(ROOT))
        for name in ("apps.py", "models.py", "models", "migrations")
        if (p := ROOT / "base" / name).exists()
    )
    assert not owned, f"base/ is a Django app: {owned}"
    assert not [a for a in settings.INSTALLED_APPS if _is_under(a, "base")]


def test_only_the_agents_and_the_benchmarks_import_the_agents_package():
    found = [
        f"{_files()[src].relative_to(ROOT)}:{line} imports {dst}"
        for src, edges in sorted(_graph().items())
        if not any(_is_under(src, p) for p in AGENTS_USERS)
        for dst, line in sorted(edges.items())
        if _is_under(dst, "agents")
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("parts", "names"),
    [
        (WITHOUT_DJANGO, DJANGO),
        (tuple(p for p in PACKAGES if p not in TORCH_USERS), ("torch",)),
    ],
    ids=["django", "torch"],
)
def test_parts_that_go_without_a_framework_do_not_import_it(parts, names):
    found = [
        f"{_files()[module].relative_to(ROOT)}:{line} imports {name}"
        for module in sorted(_files())
        if any(_is_under(module, p) for p in parts)
        for line, name in _external(module)
        if any(_is_under(name, n) for n in names)
    ]
    assert not found, "\n".join(found)


def test_parts_without_django_import_no_django_app():
    """pdd, agents and the planner import no Django app, nor the project, nor `base`, not even an
    entry point of theirs (the planner's `size --from-db` runs `manage.py planner_fleet`
    instead)."""
    found = [
        f"{_files()[src].relative_to(ROOT)}:{line} imports {dst}"
        for src, edges in sorted(_graph().items())
        if any(_is_under(src, p) for p in WITHOUT_DJANGO)
        for dst, line in sorted(edges.items())
        if any(_is_under(dst, app) for app in DJANGO_APPS)
    ]
    assert not found, "\n".join(found)


def test_the_tests_mirror_the_packages():
    """Each folder of tests/ is the tests of the project folder of the same path (tests/e2e
    alone runs across them: real agents behind the gateway)."""
    folders = {
        p.relative_to(ROOT / "tests")
        for p in (ROOT / "tests").rglob("*")
        if p.is_dir() and p.name != "__pycache__"
    }
    strays = sorted(str(f) for f in folders if f.parts[0] != "e2e" and not (ROOT / f).is_dir())
    assert not strays, f"tests/ folders with no package of that path: {strays}"


def test_the_pipeline_and_handoff_vocabulary_is_spelled_once():
    """Pipelines and handoff modes are spelled in pdd/vocab.py only; everything else, bench
    included, names them (`Pipeline.P_RLD_MD`), so a renamed value cannot leave a stale copy.
    A string literal counts (not a longer string that contains one, such as a fault name)."""
    from pdd.vocab import HandoffMode, Pipeline

    words = {str(v) for v in (*Pipeline, *HandoffMode)} - {"none"}
    found = []
    for module, path in sorted(_files().items()):
        if module == "pdd.vocab":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in words:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} spells {node.value!r}")
    assert not found, "\n".join(found)


def _private_uses(path: Path, module: str) -> list[str]:
    """Where ``path`` reaches a private name (``_x``) of another project module: ``from m
    import _x``, or ``m._x`` through a module it bound (``import m as m``, ``from pkg import
    m``)."""
    files = _files()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    bound: dict[str, str] = {}  # a local name bound to a project module -> that module
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in files:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, path, module)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in files:
                    bound[alias.asname or alias.name] = full
                elif base in files and base != module and private(alias.name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {full}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and bound.get(node.value.id, module) != module
            and private(node.attr)
        ):
            found.append(
                f"{path.relative_to(ROOT)}:{node.lineno} uses {bound[node.value.id]}.{node.attr}"
            )
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module that needs it
    needs it public (named without the underscore, documented), not reached into."""
    found = []
    for module, path in sorted(_files().items()):
        found += _private_uses(path, module)
    assert not found, "\n".join(found)


# bench/ is products beside one shared harness. A product is a folder of bench/ (bench/pdd/,
# bench/chaos/, ...) or a tool module of bench/ itself (bench/demo.py, bench/kv_index.py, ...);
# what the tests and the products share (the testbed, the fault proxy, the Celery worker, the
# benchmarks' control plane, emulated agents, prompts, checkpoints) is `bench.harness`, which
# imports no product. A product imports its own modules, the harness and the layers below.
BENCH_HARNESS = "bench.harness"
# Tools that are one product with another (the pages' render cost is the control path's).
BENCH_SAME_PRODUCT = {"bench.pages_at_scale": "bench.control_path"}


def _bench_product(module: str) -> str:
    product = ".".join(module.split(".")[:2])
    return BENCH_SAME_PRODUCT.get(product, product)


def test_bench_products_import_no_other_product_only_the_harness():
    found = [
        f"{_files()[src].relative_to(ROOT)}:{line} imports {dst}"
        for src, edges in sorted(_graph().items())
        if _is_under(src, "bench") and src != "bench"
        for dst, line in sorted(edges.items())
        if _is_under(dst, "bench") and dst != "bench"
        and _bench_product(dst) not in (_bench_product(src), BENCH_HARNESS)
    ]  # fmt: skip
    assert not found, "\n".join(found)


def test_every_bench_tool_is_named_where_a_reader_finds_it():
    """What ships in bench/ is run from the README, docs/ or a Makefile; a runnable module named
    nowhere there is a lab script (their findings stay in the reports, the scripts in the
    history). A tool is found by its path (bench/x/y.py), its module (bench.x.y) or, for a
    package's __main__, the package (bench.x)."""
    places = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("**/Makefile")]
    text = "\n".join(p.read_text() for p in places if ".venv" not in p.parts)
    unnamed = []
    for module, path in sorted(_files().items()):
        if not _is_under(module, "bench") or "__main__" not in path.read_text():
            continue
        names = {str(path.relative_to(ROOT)), module.removesuffix(".__main__")}
        if not any(re.search(rf"{re.escape(n)}(?![\w/]|\.\w)", text) for n in names):
            unnamed.append(str(path.relative_to(ROOT)))
    assert not unnamed, f"runnable but named nowhere in README.md, docs/ or a Makefile: {unnamed}"


# The gateway's request path (routing/gateway/views.py): the composer calls each step once, in
# this order; a step never imports the composer nor a step after it (the run hands a failed
# attempt to the composer's ``recover``, it does not route itself). The run writes the request's
# progress and its end through the record service (``recorder``), and frames logprobs with the
# shapes' collector: the two imports of another step it is allowed.
GATEWAY_STEPS = ("admission", "routes", "recorder", "run", "openai_shapes")
GATEWAY_STEP_USES = {("run", "recorder"), ("run", "openai_shapes")}


def test_the_gateway_path_is_a_line():
    steps = {f"routing.gateway.{s}": s for s in GATEWAY_STEPS}
    found = []
    for src, step in steps.items():
        for dst, line in sorted(_graph().get(src, {}).items()):
            if dst == "routing.gateway.views":
                found.append(f"{src}:{line} imports the composer (views)")
            elif dst in steps and dst != src and (step, steps[dst]) not in GATEWAY_STEP_USES:
                found.append(f"{src}:{line} imports another step of the path, {dst}")
    assert not found, "\n".join(found)
