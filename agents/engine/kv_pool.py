"""Paged KV cache pool: fixed-size blocks of K/V for every layer, a free list, and the byte
format in which a request's KV for a token range is shipped between engines. The format and the
pool interface load no torch (an emulated engine uses them); PagedKVPool imports it."""

from __future__ import annotations

import struct
import sys
import warnings
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# Wire format of export_kv / import_kv (all little-endian):
#   header, 24 bytes, struct "<4sBBHHHIII":
#     magic b"BKV1" | version u8 (=1) | dtype code u8 (0 float32, 1 bfloat16, 2 float16,
#     3 int8: 8-bit transport with per-block scales, its body laid out in kv_codec.py)
#     | num_layers u16 | num_kv_heads u16 | head_dim u16
#     | start_token u32 | end_token u32 | reserved u32 (=0; an emulated engine's payload has
#     num_layers 0, no tensor, and its bytes per token here: agents/engine/emulated.py; an
#     int8 payload has its scales' block size in tokens here)
#   body: one C-order tensor shaped [2, num_layers, end_token - start_token, num_kv_heads,
#     head_dim] of the header's dtype; index 0 of the first axis is K, 1 is V. Keys are stored
#     after RoPE (as the attention reads them), so the receiver copies them verbatim.
KV_MAGIC = b"BKV1"
KV_VERSION = 1
_HEADER = struct.Struct("<4sBBHHHIII")
KV_HEADER_BYTES = _HEADER.size
# dtype code -> name (agents.engine.config.DTYPE_NAMES, and the 8-bit transport format)
_CODE_NAMES = {0: "float32", 1: "bfloat16", 2: "float16", 3: "int8"}
INT8_CODE = 3


def format_code(name: str) -> int:
    """The header's code of a format name (float32, bfloat16, float16, int8)."""
    for code, known in _CODE_NAMES.items():
        if known == name:
            return code
    raise ValueError(f"unknown KV format {name!r}; known: {', '.join(_CODE_NAMES.values())}")


def format_name(code: int) -> str:
    return _CODE_NAMES[code]


assert KV_HEADER_BYTES == 24, "header must stay 8-byte aligned for the body's elements"
assert sys.byteorder == "little", "the KV wire format assumes a little-endian host"


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than requested."""


def _dtype_code(dtype: torch.dtype) -> int:
    import torch

    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    if dtype not in codes:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return codes[dtype]


class KVHeader(NamedTuple):
    dtype_code: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    start_token: int
    end_token: int
    reserved: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    @property
    def dtype_name(self) -> str:
        return _CODE_NAMES[self.dtype_code]

    @property
    def dtype(self) -> torch.dtype:
        """The body's torch dtype (imports torch)."""
        from agents.engine.config import parse_dtype

        return parse_dtype(self.dtype_name)


def read_kv_header(payload: bytes | bytearray | memoryview) -> KVHeader:
    """Parse and check the header of a KV payload (does not read the body)."""
    if len(payload) < KV_HEADER_BYTES:
        raise ValueError(f"KV payload too short for its header: {len(payload)} bytes")
    magic, version, code, layers, heads, dim, start, end, reserved = _HEADER.unpack_from(payload, 0)
    if magic != KV_MAGIC or version != KV_VERSION:
        raise ValueError(f"not a KV payload of version {KV_VERSION} (magic {magic!r}, v{version})")
    if code not in _CODE_NAMES:
        raise ValueError(f"KV payload has unknown dtype code {code}")
    if end < start:
        raise ValueError(f"KV payload range is reversed: [{start}, {end})")
    return KVHeader(code, layers, heads, dim, start, end, reserved)


def kv_header(
    dtype_code: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    start_token: int,
    end_token: int,
    reserved: int = 0,
) -> bytes:
    """The 24-byte header of a KV payload (format above)."""
    return _HEADER.pack(
        KV_MAGIC,
        KV_VERSION,
        dtype_code,
        num_layers,
        num_kv_heads,
        head_dim,
        start_token,
        end_token,
        reserved,
    )


class KVPool(ABC):
    """A paged KV store. Block ids index the second axis of `k_cache` / `v_cache`."""

    block_size: int
    num_blocks: int
    k_cache: torch.Tensor  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # same shape as k_cache

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks available to `allocate` (read-only)."""

    @property
    def num_used_blocks(self) -> int:
        """Blocks handed out and not yet freed (read-only)."""
        return self.num_blocks - self.num_free_blocks

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """Mutates: take `n` free blocks (contents undefined). Raises OutOfBlocks if short."""

    @abstractmethod
    def free(self, blocks: list[int]) -> None:
        """Mutates: return blocks to the free list. Freeing a free block is an error."""

    @abstractmethod
    def export_kv(self, block_table: list[int], start_token: int, end_token: int) -> bytes:
        """Read-only: the KV of positions [start_token, end_token) of the sequence whose
        positions live in `block_table`, in the wire format above."""

    @abstractmethod
    def import_kv(self, payload: bytes | bytearray | memoryview, blocks: list[int]) -> KVHeader:
        """Mutates the given blocks only: write a payload's KV into freshly allocated `blocks`,
        the first of which holds position start_token (which must be block-aligned)."""

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)


class PagedKVPool(KVPool):
    """KVPool over two preallocated tensors with a LIFO free list."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        import torch

        dtype = torch.float32 if dtype is None else dtype
        _dtype_code(dtype)  # a supported dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.k_cache.device
        # Pop from the end so block 0 is handed out first (easier to read in tests and dumps).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert 0 <= b < self.num_blocks, f"block {b} outside pool of {self.num_blocks}"
            assert not self._is_free[b], f"double free of KV block {b}"
            self._is_free[b] = True
            self._free.append(b)

    def slots(self, block_table: list[int], start_token: int, end_token: int) -> torch.Tensor:
        """Flat slot index (block * block_size + offset) of each position in the range."""
        import torch

        assert 0 <= start_token <= end_token, f"bad range [{start_token}, {end_token})"
        assert end_token <= len(block_table) * self.block_size, (
            f"range end {end_token} beyond {len(block_table)} blocks of {self.block_size}"
        )
        pos = torch.arange(start_token, end_token)
        table = torch.tensor(block_table, dtype=torch.long)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.to(self.device)

    @property
    def dtype_name(self) -> str:
        """The pool's dtype as the wire format names it (float32, bfloat16, float16)."""
        return _CODE_NAMES[_dtype_code(self.k_cache.dtype)]

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        layers, blocks, bs, heads, dim = self.k_cache.shape
        shape = (layers, blocks * bs, heads, dim)
        return self.k_cache.view(shape), self.v_cache.view(shape)

    def export_kv(self, block_table: list[int], start_token: int, end_token: int) -> bytes:
        import torch

        layers, _, _, heads, dim = self.k_cache.shape
        slots = self.slots(block_table, start_token, end_token)
        k, v = self._flat()
        body = torch.stack((k[:, slots], v[:, slots])).contiguous()  # [2, L, n, KVH, D]
        header = kv_header(
            _dtype_code(self.k_cache.dtype), layers, heads, dim, start_token, end_token
        )
        return header + body.cpu().view(torch.uint8).numpy().tobytes()

    def import_kv(self, payload: bytes | bytearray | memoryview, blocks: list[int]) -> KVHeader:
        import torch

        header = read_kv_header(payload)
        layers, _, bs, heads, dim = self.k_cache.shape
        if (header.num_layers, header.num_kv_heads, header.head_dim) != (layers, heads, dim):
            raise ValueError(
                f"KV payload shape (layers, kv_heads, head_dim) = "
                f"{(header.num_layers, header.num_kv_heads, header.head_dim)} does not match "
                f"this pool's {(layers, heads, dim)}"
            )
        if header.dtype_name != self.dtype_name:
            raise ValueError(
                f"KV payload format {header.dtype_name} != pool dtype {self.dtype_name} "
                "(kv_codec.decode_to converts it)"
            )
        if header.start_token % bs:
            raise ValueError(f"KV payload start {header.start_token} is not a multiple of {bs}")
        n = header.num_tokens
        if len(blocks) != self.blocks_for(n):
            raise ValueError(f"{n} tokens need {self.blocks_for(n)} blocks, got {len(blocks)}")
        elem = self.k_cache.element_size()
        expected = KV_HEADER_BYTES + 2 * layers * n * heads * dim * elem
        if len(payload) != expected:
            raise ValueError(f"KV payload is {len(payload)} bytes, expected {expected}")
        if n == 0:
            return header
        with warnings.catch_warnings():
            # The body is only read (then copied into the pool), so a read-only buffer is fine.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8, offset=KV_HEADER_BYTES)
        body = raw.view(header.dtype).view(2, layers, n, heads, dim).to(self.device)
        slots = self.slots(blocks, 0, n)
        k, v = self._flat()
        k[:, slots] = body[0]
        v[:, slots] = body[1]
        return header
