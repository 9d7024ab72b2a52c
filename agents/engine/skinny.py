"""Skinny linears: a decode step's x @ W.T at 1-16 rows in one pass over a prepacked weight.

At a decode step's few rows a linear layer is a pass over its weight, and the step is a pass
over all of them: MKL and oneDNN read the weights well below the machine's bandwidth there
(bench/engine/REPORT.md). The kernel (agents/engine/kernels/skinny_linear.cpp) reads each
weight from a copy packed into panels of :data:`PANEL` output columns, one sequential stream
per thread, with float32 accumulation in float32 and in bfloat16 (AVX512-BF16's dot product).
``EngineConfig.decode_weights="stream"`` uses it for the decode fast path's linears, with the
library's decode attention (:func:`attention`: each request's scores computed, softmaxed and
applied in one pass over its keys and values, in the thread's cache), RMSNorm, the rotary
embedding and the MLP's silu(gate) * up, each one call where torch makes several small ones.

It is C++ for x86 CPUs with AVX-512 and AVX512-BF16, compiled with the system's C++ compiler
(``$CXX``, else ``g++``) against the installed torch into ``build/kernels/`` the first time it
is needed (about 10 s; ``make setup`` builds it ahead), then loaded with
``torch.ops.load_library``. The library's name carries a digest of the source, torch's version
and the flags, so an edit or another torch builds a new one and a stale one is never loaded.
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
import torch.nn.functional as F

log = logging.getLogger(__name__)

PANEL = 48  # output columns per packed panel (the kernel's kPanel: 3 AVX-512 vectors)
MAX_ROWS = 16  # the kernel's kMaxRows
SOURCE = Path(__file__).resolve().parent / "kernels" / "skinny_linear.cpp"
ROOT = Path(__file__).resolve().parents[2]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CXXFLAGS = (
    "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
)  # fmt: skip

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason = ""


def build_dir() -> Path:
    """Where the library is built: ``$BATON_KERNEL_DIR``, else ``build/kernels/`` (not the
    planner's ``build/native/``, which its build replaces whole)."""
    return Path(os.environ.get("BATON_KERNEL_DIR", ROOT / "build" / "kernels"))


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def library_path() -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join((*CXXFLAGS, _abi_flag())).encode())
    return build_dir() / f"skinny_linear-{digest.hexdigest()[:16]}.so"


def cpu_support() -> str:
    """ "" when this CPU runs the kernel, else why not."""
    if sys.platform != "linux":
        return "built and checked on Linux only"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else ""


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
        os.environ.get("CXX", "g++"), *CXXFLAGS, _abi_flag(),
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


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of `weight` [N, K]: panels of PANEL output columns (the last padded
    with zeros), each [K, PANEL] in float32 and [K / 2, PANEL, 2] in bfloat16."""
    if not supports(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight")
    n, k = weight.shape
    w = weight.detach()
    if n % PANEL:
        w = F.pad(w, (0, 0, 0, PANEL - n % PANEL))
    if w.dtype == torch.float32:
        return w.reshape(-1, PANEL, k).transpose(1, 2).contiguous()
    return w.reshape(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
