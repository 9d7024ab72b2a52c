"""Skinny linears: a decode step's x @ W.T at 1-64 rows in one pass over a prepacked weight.

At a decode step's few rows a linear layer is a pass over its weight, and the step is a pass
over all of them: MKL and oneDNN read the weights well below the machine's bandwidth there
(bench/engine/REPORT.md). The kernel (agents/engine/kernels/skinny_linear.cpp) reads each
weight from a copy packed into panels of :func:`panel` output columns, one sequential stream
per thread, with float32 accumulation in float32 and in bfloat16 (AMX's tile dot product
where the CPU has it, :func:`amx`; else AVX512-BF16's, or bfloat16 widened to float32 as it
is loaded).
``EngineConfig.decode_weights="stream"`` uses it for the decode fast path's linears, with the
library's decode attention (:func:`attention`: each request's scores computed, softmaxed and
applied in one pass over its keys and values, in the thread's cache), RMSNorm, the rotary
embedding and the MLP's silu(gate) * up, each one call where torch makes several small ones.

It is C++ for x86 CPUs with AVX-512 and AVX512-BF16 or with AVX2 and FMA (:data:`ISAS`; the
best this CPU has), compiled with the system's C++ compiler (``$CXX``, else ``g++``) against
the installed torch into ``build/kernels/`` the first time it is needed (about 20 s; ``make
setup`` builds it ahead), then loaded with
``torch.ops.load_library``. The library's name carries the instruction set and a digest of the
source, torch's version and the flags, so an edit, another torch or another CPU builds a new
one and a stale one is never loaded.
:func:`available` says whether it could be used here, :func:`unavailable_reason` why not; the
engine then keeps its default linears.

``python -m agents.engine.kernels build|status``: build it now / say whether it loads here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 64  # the kernel's kMaxRows
SOURCE = Path(__file__).resolve().parent / "kernels" / "skinny_linear.cpp"
ROOT = Path(__file__).resolve().parents[2]
# The instruction sets the source compiles for, best first: the CPU flags each needs and the
# compiler flags that select it (agents/engine/kernels/skinny_linear.cpp picks its vectors by
# them). ``$BATON_KERNEL_ISA`` names one to use instead of the best this CPU has.
ISAS = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
    ),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
}
BASE_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason = ""


def build_dir() -> Path:
    """Where the library is built: ``$BATON_KERNEL_DIR``, else ``build/kernels/`` (not the
    planner's ``build/native/``, which its build replaces whole)."""
    return Path(os.environ.get("BATON_KERNEL_DIR", ROOT / "build" / "kernels"))


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _cpu_flags() -> set[str] | str:
    """This CPU's flags, or why they cannot be read."""
    if sys.platform != "linux":
        return "built and checked on Linux only"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa() -> tuple[str, str]:
    """(the instruction set the kernels are built for here, "") or ("", why none)."""
    flags = _cpu_flags()
    if isinstance(flags, str):
        return "", flags
    wanted = os.environ.get("BATON_KERNEL_ISA", "")
    if wanted and wanted not in ISAS:
        return "", f"BATON_KERNEL_ISA={wanted}: not one of {', '.join(ISAS)}"
    missing: list[str] = []
    for name in [wanted] if wanted else list(ISAS):
        missing = [flag for flag in ISAS[name][0] if flag not in flags]
        if not missing:
            return name, ""
    prefix = f"BATON_KERNEL_ISA={wanted}: " if wanted else ""
    return "", f"{prefix}the CPU lacks {', '.join(missing)}"


def cpu_support() -> str:
    """ "" when this CPU runs the kernels, else why not."""
    return isa()[1]


def cxxflags(name: str | None = None) -> tuple[str, ...]:
    """The compiler's flags for instruction set `name` (default: this CPU's; with none the
    source refuses to compile)."""
    name = isa()[0] if name is None else name
    return (*BASE_FLAGS, *(ISAS[name][1] if name else ()))


def library_path() -> Path:
    name = isa()[0]
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join((*cxxflags(name), _abi_flag())).encode())
    return build_dir() / f"skinny_linear-{name or 'none'}-{digest.hexdigest()[:16]}.so"


def build(path: Path | None = None) -> Path:
    """Compile the kernel (RuntimeError with the compiler's last words if that fails)."""
    path = path or library_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch_dir = Path(torch.__file__).resolve().parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    # Into a temporary name first: agents starting side by side never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=path.stem + "-", suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    cmd = [
        os.environ.get("CXX", "g++"), *cxxflags(), _abi_flag(),
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE), f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}",
        "-o", tmp,
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise RuntimeError(f"cannot run the C++ compiler: {exc}") from None
    if done.returncode != 0:
        os.unlink(tmp)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"the C++ compiler failed ({done.returncode}): {last}")
    os.replace(tmp, path)
    return path


def available() -> bool:
    """Whether torch.ops.baton.skinny_linear runs here: the CPU has the instructions and the
    library is built (now, if it was not) and loaded. Tried once per process."""
    global _loaded, _reason
    with _lock:
        if _loaded is not None:
            return _loaded
        _loaded, _reason = False, cpu_support()
        if _reason:
            return False
        path = library_path()
        try:
            if not path.is_file():
                log.info("building the skinny-linear kernel into %s", path)
                build(path)
            torch.ops.load_library(str(path))
        except (RuntimeError, OSError) as exc:
            _reason = str(exc)
            return False
        _loaded = True
        return True


def unavailable_reason() -> str:
    available()
    return _reason


def supports(weight: torch.Tensor) -> bool:
    """Whether a weight can be packed for the kernel (CPU, float32 or bfloat16 with even K)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0


def panel() -> int:
    """Output columns per packed panel in this build (48 with AVX-512, 8 with AVX2)."""
    return int(torch.ops.baton.panel_width())


def amx() -> bool:
    """Whether bfloat16 linears (input size a multiple of 32) run on AMX's tile unit here: the
    AVX-512 build on a CPU with AMX-TILE and AMX-BF16 whose kernel grants the tile state,
    unless ``BATON_AMX=0`` (read once per process)."""
    return available() and bool(torch.ops.baton.amx_in_use())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of `weight` [N, K]: panels of :func:`panel` output columns (the last
    padded with zeros), each [K, panel] (bfloat16 with AVX-512: [K / 2, panel, 2])."""
    if not supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight")
    return torch.ops.baton.pack(weight.detach())


def linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for 1 <= M <= MAX_ROWS, W given as pack(W) with N = n rows."""
    return torch.ops.baton.skinny_linear(x, packed, n, bias)


def attention_supported(kv_copy: torch.Tensor | None, head_dim: int) -> bool:
    """Whether :func:`attention` takes a decode step over this KV copy (float32 on the CPU,
    head dim a multiple of 16 up to 256) here."""
    return (
        kv_copy is not None
        and kv_copy.device.type == "cpu"
        and kv_copy.dtype == torch.float32
        and head_dim % 16 == 0
        and head_dim <= 256
        and available()
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_counts: torch.Tensor
) -> torch.Tensor:
    """softmax(q @ k^T) @ v of a decode step, float32: q [B, H, G, D] (already scaled), k and
    v [B, H, C, D] (last dim contiguous), request b over its first key_counts[b] keys."""
    return torch.ops.baton.decode_attention(q, k, v, key_counts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] in one call (float32 as F.rms_norm; bfloat16 as the engine's
    bfloat16 path: normalised in float32, rounded, times the weight)."""
    return torch.ops.baton.rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output [M, 2I], in one call."""
    return torch.ops.baton.silu_mul(gate_up)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The rotary embedding of qkv [B, NH, D]'s first `heads` heads (cos, sin [B, D]), with
    torch's roundings; head dim a multiple of 32."""
    return torch.ops.baton.rope(qkv, cos, sin, heads)


def decode_layers(
    x: torch.Tensor,
    norms: list[torch.Tensor],
    packed: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    out_features: list[int],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    write_slots: torch.Tensor,
    k_copy: torch.Tensor,
    v_copy: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Every decoder layer of a decode step in one call (returns the new x [B, hidden]):
    per layer RMSNorm, QKV, RoPE, the new K/V into the pool [L, slots, KVH, D] at write_slots
    and into the float32 KV copy [L, B, KVH, C, D] at positions, attention over each request's
    first lengths[b] keys, o_proj + residual, RMSNorm, gate/up, silu * up, down + residual,
    with the same kernels and roundings as the engine's op-by-op stream step. Per layer two
    norm weights and four linears (qkv, o, gate/up, down: :func:`pack`ed, bias or None, output
    size); cos, sin [B, D]; x's dtype throughout but the copy."""
    return torch.ops.baton.decode_layers(
        x, norms, packed, biases, out_features, eps, cos, sin, k_pool, v_pool, write_slots,
        k_copy, v_copy, positions, lengths, heads, kv_heads, scale,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["build"], ["status"]):
        print("usage: python -m agents.engine.kernels build|status", file=sys.stderr)
        return 2
    if args == ["build"]:
        reason = cpu_support()
        if reason:
            print(f"skinny linears: not built: {reason}")
            return 0  # nothing to build on this CPU; the engine keeps its default linears
        if library_path().is_file():
            print(f"skinny linears: up to date ({library_path()})")
            return 0
        try:
            print(f"skinny linears: built {build()}")
        except RuntimeError as exc:
            print(f"skinny linears: {exc}", file=sys.stderr)
            return 1
        return 0
    ok = available()
    print(f"skinny linears: {'loaded ' + str(library_path()) if ok else unavailable_reason()}")
    if ok:
        print(f"bfloat16 linears on AMX: {'yes' if amx() else 'no'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
