"""The simulator's hot modules compiled to C with mypyc, used only while they match the source.

The simulator is plain Python; every figure it prints comes from that source. ``make setup``
also compiles the modules in :data:`MODULES` with mypyc (part of mypy, already the project's
type checker) into ``build/native/``: the same code, the same float operations in the same
order, 1.5-1.6x faster (bench/planner/speed.md). ``planner/__init__.py`` calls
:func:`enable`, which puts the compiled modules ahead of the sources only when the build's
stamp names the exact sources on disk now (a digest of the compiled modules, every project
module they import, the Python and mypy versions). Edit a source and the planner runs the
pure-Python modules again, with a one-line warning, until ``make setup`` (or
``python -m planner native build``) rebuilds: a stale build is never used.

``BATON_PLANNER_NATIVE=0`` runs pure Python whatever is built (to compare the two, or debug).
``python -m planner native status`` says which one a process runs, and why.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

# The modules a simulation spends its time in (the event loop, instances, WAN, host, the
# simulator, its metrics). planner.fleet is not compiled: its enum-like classes are read
# through the class object, which mypyc's native classes do not allow.
# The spec classes built from user input (GpuType, EngineSpec, WanLinkSpec, Sla, ...) stay
# plain Python classes (``@mypyc_attr(native_class=False)``): a native class refuses a wrongly
# typed field with its own TypeError before ``__post_init__`` can name the field and the reason.
MODULES = ("events", "instances", "wan", "host", "sim", "metrics")
ROOT = Path(__file__).resolve().parent.parent
ENV_SWITCH = "BATON_PLANNER_NATIVE"
STAMP = "stamp.json"

# Set by enable(): "native", "disabled", "not built", "stale", "build failed".
state = "not enabled"
reason = ""


def build_dir() -> Path:
    return Path(os.environ.get("BATON_NATIVE_DIR", ROOT / "build" / "native"))


def _sources(root: Path = ROOT) -> list[Path]:
    """The compiled modules and every project module they import (the compiled code reads
    those modules' classes and constants as they were at build time)."""
    todo = [f"planner.{m}" for m in MODULES]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        if name in seen or not path.is_file():
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo.append(node.module)
                todo.extend(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                todo.extend(alias.name for alias in node.names)
    return sorted(root.joinpath(*n.split(".")).with_suffix(".py") for n in seen)


def _mypy_version() -> str:
    try:
        from importlib.metadata import version

        return version("mypy")
    except Exception:  # not installed: no build can match
        return "none"


def source_names(root: Path = ROOT) -> list[str]:
    """:func:`_sources` as paths relative to ``root`` (what a build's stamp records)."""
    return [path.relative_to(root).as_posix() for path in _sources(root)]


def digest(names: list[str] | None = None, root: Path = ROOT) -> str:
    """What a build was made from: the sources it may depend on (``names``, default found
    from the imports), Python and mypy versions. A stamp records its names, so checking a
    build reads the files without parsing them: an edit that adds an import changes a file
    already named, which is enough to make the build stale."""
    h = hashlib.sha256()
    h.update(sys.version.encode())
    h.update(_mypy_version().encode())
    for name in source_names(root) if names is None else names:
        path = root / name
        h.update(name.encode() + b"\0")
        h.update((path.read_bytes() if path.is_file() else b"<missing>") + b"\0")
    return h.hexdigest()


def _disabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def enable(package_path: list[str]) -> bool:
    """Put the compiled modules first on the planner package's path if the build is current."""
    global state, reason
    if _disabled():
        state, reason = "disabled", f"{ENV_SWITCH}=0"
        return False
    where = build_dir()
    try:
        stamp = json.loads((where / STAMP).read_text())
    except (OSError, ValueError):
        state, reason = "not built", f"no build in {where} (make setup builds it)"
        return False
    if not stamp.get("digest"):
        state, reason = "build failed", str(stamp.get("error", "unknown error"))
        return False
    names = stamp.get("sources")
    if not isinstance(names, list) or stamp["digest"] != digest(names):
        state, reason = "stale", "the sources changed since the build"
        print(
            f"planner: the compiled simulator in {where} is out of date (sources changed); "
            "running pure Python. Rebuild: make setup (or python -m planner native build)",
            file=sys.stderr,
        )
        return False
    native = str(where / "planner")
    if native not in package_path:
        package_path.insert(0, native)
    if str(where) not in sys.path:
        sys.path.append(str(where))  # mypyc's shared runtime module is a top-level one
    state, reason = "native", f"compiled modules from {where}"
    return True


def build(where: Path | None = None) -> int:
    """Compile :data:`MODULES` into ``where`` (default :func:`build_dir`); 0 on success.

    Builds in a scratch folder and swaps it in whole, so a failed or interrupted build never
    leaves a half-written one; a failure writes a stamp with the error (the planner then runs
    pure Python) and returns 1.
    """
    where = where or build_dir()
    names = source_names()
    source_digest = digest(names)  # before the build reads them: an edit during it is stale
    scratch = where.with_name(where.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    began = time.perf_counter()
    try:
        from mypyc.build import mypycify
        from setuptools import setup

        cwd = os.getcwd()
        os.chdir(ROOT)  # mypyc names the modules from their paths: planner/sim.py -> planner.sim
        try:
            extensions = mypycify(
                [f"planner/{m}.py" for m in MODULES], target_dir=str(scratch / "c")
            )
            setup(
                name="baton-planner-native",
                ext_modules=extensions,
                script_args=["--quiet", "build_ext", "--build-lib", str(scratch),
                             "--build-temp", str(scratch / "obj")],
            )  # fmt: skip
        finally:
            os.chdir(cwd)
    except (Exception, SystemExit) as exc:  # setup() exits on a compiler error
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        shutil.rmtree(scratch, ignore_errors=True)
        where.mkdir(parents=True, exist_ok=True)
        (where / STAMP).write_text(json.dumps({"error": message}) + "\n")
        print(f"planner: native build failed ({message}); the planner runs pure Python",
              file=sys.stderr)  # fmt: skip
        return 1
    for junk in ("c", "obj"):
        shutil.rmtree(scratch / junk, ignore_errors=True)
    (scratch / STAMP).write_text(
        json.dumps({"digest": source_digest, "sources": names, "modules": list(MODULES),
                    "built_s": round(time.perf_counter() - began, 1)}) + "\n"
    )  # fmt: skip
    shutil.rmtree(where, ignore_errors=True)
    scratch.rename(where)
    print(f"planner: compiled {', '.join(MODULES)} into {where} "
          f"({time.perf_counter() - began:.0f} s)")  # fmt: skip
    return 0
