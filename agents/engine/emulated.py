"""The emulated engine: the engine core's scheduler, KV pool and radix prefix cache as
accounting (blocks, no tensors, no torch), step times from the hardware model (pdd/hardware.py)
for the instance's GPU unit, and greedy tokens that are a function of the whole context.

It runs the real engine's code for everything but the forward pass (continuous batching,
decode slots, chunked prefill, preemption, the prefix cache at the unit's real memory
capacity, prefill / export / import / extend / handoff), so every pipeline and the control
plane behave as with real engines, while an idle instance costs nothing and a busy one one
sleeping thread. Tokens equal across pipelines by construction: `single`, P-MD and P-RLD-MD
must give the same ones, as on the real engine.

KV payloads carry no tensor: a header (the torch engine's, with zero layers) and
``kv_bytes_per_token / kv_scale`` bytes per token, so that a transfer over a link shaped to
``bandwidth / kv_scale`` takes the time the real bytes take on the real link. A profile's KV is
taken to be bfloat16 (``EMULATED_KV_DTYPE``); sent in another transport format (a WAN link's
``kv_format``) a payload takes that format's bytes (``as_format``: float32 twice, int8 half plus
its scales), so switching a link's format changes what crosses it as on real engines."""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from agents.engine.config import EngineConfig
from agents.engine.core import EngineCore
from agents.engine.interface import EMULATED
from agents.engine.kv_pool import (
    KV_HEADER_BYTES,
    KVHeader,
    KVPool,
    OutOfBlocks,
    format_code,
    kv_header,
    read_kv_header,
)
from agents.engine.outputs import ImportResult, TokenLogprob, TokenOutput
from agents.engine.radix_cache import RadixCache
from agents.engine.request import AfterForward, Request, SamplingParams
from agents.engine.scheduler import Scheduler
from pdd.checks import check_number
from pdd.hardware import GpuType, forward_time, transfer_time
from pdd.kv_formats import PROFILE_KV_DTYPE, wire_factor
from pdd.profiles import ModelProfile

# Emulated tokens are printable ASCII bytes (the byte tokenizer's ids 32..126), never EOS:
# a request runs to its max_tokens, as the traces' output lengths say.
FIRST_TOKEN, NUM_TOKENS = 32, 95
# Steps remembered for the state document and the tests (kind, batch, tokens, seconds).
STEP_HISTORY = 256


# The dtype a profile's kv_bytes_per_token is taken to be in (profiles do not say); each
# transport format's bytes relative to it are pdd/kv_formats.py's (int8: one byte plus one
# float32 scale per 16-token block of a 64-value head, the real engine's 8-bit transport).
EMULATED_KV_DTYPE = PROFILE_KV_DTYPE


def format_bytes_per_token(own_bytes_per_token: float, fmt: str | None) -> float:
    """Bytes per token of KV of ``own_bytes_per_token`` (EMULATED_KV_DTYPE) in format ``fmt``
    (None: its own)."""
    return own_bytes_per_token * wire_factor(fmt, EMULATED_KV_DTYPE)


def as_format(payload: bytes | bytearray | memoryview, fmt: str) -> bytes:
    """An emulated payload as it would cross in ``fmt``: the same tokens, its format in the
    header, and that format's bytes per token (from the payload's own, whatever it is)."""
    header = read_kv_header(payload)
    if header.num_layers:
        raise ValueError("as_format takes an emulated payload (no tensors)")
    if header.dtype_name == fmt:
        return bytes(payload)
    own = header.reserved / wire_factor(header.dtype_name, EMULATED_KV_DTYPE)
    wire = max(1, round(format_bytes_per_token(own, fmt)))
    n = header.num_tokens
    return kv_header(format_code(fmt), 0, 0, 0, header.start_token, header.end_token, wire) + bytes(
        n * wire
    )


@dataclass(slots=True)
class EmulatedModel:
    """The model facts the agent checks requests against (ModelConfig's, for a profile)."""

    name: str
    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...] = ()


class BlockPool(KVPool):
    """A KV pool of block ids only. Capacity can be millions of blocks: ids are handed out from
    a counter and recycled through a free stack, so memory grows with use, not capacity."""

    def __init__(self, num_blocks: int, block_size: int, wire_bytes_per_token: int) -> None:
        if num_blocks < 1 or block_size < 1 or wire_bytes_per_token < 1:
            raise ValueError("num_blocks, block_size and wire_bytes_per_token must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.wire_bytes_per_token = wire_bytes_per_token
        self._next = 0  # blocks [0, _next) were handed out at least once
        self._recycled: list[int] = []
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise OutOfBlocks(
                f"need {n} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        take = min(n, len(self._recycled))
        blocks = self._recycled[len(self._recycled) - take :]
        del self._recycled[len(self._recycled) - take :]
        fresh = n - take
        blocks += range(self._next, self._next + fresh)
        self._next += fresh
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b in self._used, f"double free of KV block {b}"
            self._used.remove(b)
            self._recycled.append(b)

    def export_kv(self, block_table: list[int], start_token: int, end_token: int) -> bytes:
        assert 0 <= start_token <= end_token <= len(block_table) * self.block_size, (
            f"bad range [{start_token}, {end_token}) for {len(block_table)} blocks"
        )
        n = end_token - start_token
        # Zero layers mark a payload without tensors; `reserved` carries its bytes per token.
        code = format_code(EMULATED_KV_DTYPE)
        header = kv_header(code, 0, 0, 0, start_token, end_token, self.wire_bytes_per_token)
        return header + bytes(n * self.wire_bytes_per_token)

    def import_kv(self, payload: bytes | bytearray | memoryview, blocks: list[int]) -> KVHeader:
        header = read_kv_header(payload)
        if header.num_layers:
            raise ValueError(
                "KV payload holds real tensors (a torch engine's); an emulated engine imports "
                "only an emulated engine's KV"
            )
        if header.start_token % self.block_size:
            raise ValueError(f"KV payload start {header.start_token} is not block-aligned")
        n = header.num_tokens
        if len(blocks) != self.blocks_for(n):
            raise ValueError(f"{n} tokens need {self.blocks_for(n)} blocks, got {len(blocks)}")
        # Any transport format (as_format): its bytes per token follow from this engine's.
        fmt = header.dtype_name
        wire = max(1, round(format_bytes_per_token(self.wire_bytes_per_token, fmt)))
        expected = KV_HEADER_BYTES + n * wire
        if len(payload) != expected or header.reserved != wire:
            raise ValueError(
                f"KV payload is {len(payload)} bytes, expected {expected} (this engine sends "
                f"{wire} bytes per token in {fmt}: same profile and kv_scale?)"
            )
        return header


class StepRecord(NamedTuple):
    kind: str  # "decode" (one position per request) or "extend" (prefill chunks, handoffs)
    batch: int  # requests in the forward
    new_tokens: int  # positions run
    context_tokens: int  # positions already held by those requests
    seconds: float  # modelled duration (before speedup)


class Pacer:
    """Makes modelled time pass on a clock: a charge that follows the previous one without
    idle time between them (``continuous``) ends ``seconds / speedup`` after the previous one
    ended on the modelled timeline, so sleeps that woke late are made up by the next ones (at
    most CATCH_UP_S) and a busy engine keeps the modelled rate on a loaded host; after idle
    time a charge ends ``seconds / speedup`` from now."""

    CATCH_UP_S = 0.25

    def __init__(
        self,
        speedup: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.speedup = check_number(speedup, "speedup", gt=0)
        self.clock = clock
        self.sleep = sleep
        self._until = 0.0
        self.charged_s = 0.0  # modelled seconds charged so far (before speedup)
        # Wall seconds a busy engine fell behind its model beyond the catch-up (a host too
        # loaded to keep the modelled rate): 0 when the emulation is faithful.
        self.lost_s = 0.0

    def charge(self, seconds: float, *, continuous: bool = False) -> None:
        self.charged_s += seconds
        now = self.clock()
        if continuous and now - self.CATCH_UP_S > self._until:
            self.lost_s += now - self.CATCH_UP_S - self._until
        start = max(self._until, now - self.CATCH_UP_S) if continuous else now
        self._until = max(start, self._until) + seconds / self.speedup
        wait = self._until - now
        if wait > 0:
            self.sleep(wait)


@dataclass(slots=True)
class _Context:
    """A request's running hash over its token ids, for its next deterministic token."""

    digest: Any
    hashed: int = 0


def context_token(token_ids: Sequence[int], seed: int | None = None) -> int:
    """The token an emulated engine emits after ``token_ids`` (a pure function of them)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(array("I", token_ids).tobytes())
    return token_of(h.digest(), seed)


def token_of(digest: bytes, seed: int | None) -> int:
    if seed is not None:
        digest = hashlib.blake2b(digest + seed.to_bytes(8, "little", signed=True)).digest()
    return FIRST_TOKEN + int.from_bytes(digest[:8], "little") % NUM_TOKENS


class EmulatedEngine(EngineCore):
    """An engine instance of a model profile on one GPU unit, with modelled step times."""

    kind = EMULATED

    def __init__(
        self,
        profile: ModelProfile,
        gpu: GpuType,
        config: EngineConfig | None = None,
        *,
        kv_scale: float = 1.0,
        speedup: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        # No model, no tensors, no torch: the engine core runs unchanged over block accounting.
        base = config or EngineConfig()
        self.profile = profile
        self.gpu = gpu
        # KV bytes on the wire = real bytes / kv_scale (the agent shapes its links alike).
        self.kv_scale = check_number(kv_scale, "kv_scale", ge=1)
        self.pacer = Pacer(speedup, clock, sleep)
        # The last STEP_HISTORY forwards with their modelled durations.
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        capacity = profile.kv_capacity_tokens(gpu)
        num_blocks = capacity // base.block_size
        if num_blocks < 1:
            raise ValueError(
                f"gpu: a unit of {gpu.name} ({gpu.mem_gb:g} GB) leaves no room for KV beside "
                f"{profile.name}'s {profile.resident_weight_gb:g} GB of weights"
            )
        self.config = EngineConfig(
            block_size=base.block_size,
            num_blocks=num_blocks,
            max_running=profile.engine.max_decode_batch,
            max_queued=base.max_queued,
            max_batch_tokens=profile.engine.prefill_batch_tokens,
            seed=base.seed,
            device="cpu",
            mixed_batches=True,
        )
        self.model_config = EmulatedModel(profile.name, profile.vocab_size, profile.max_position)
        wire = max(1, round(profile.model.kv_bytes_per_token / self.kv_scale))
        self.pool = BlockPool(num_blocks, base.block_size, wire)
        self.cache = RadixCache(base.block_size)
        self.scheduler = Scheduler(self.config, self.pool, self.cache)
        self.requests = {}
        self._undelivered = []
        self._contexts: dict[str, _Context] = {}
        self._busy = False
        self._init_counters()

    # -- what the agent reports ----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        g = self.gpu
        return {
            "kind": EMULATED,
            "profile": self.profile.name,
            "gpu": {
                "name": g.name,
                "peak_tflops": g.peak_tflops,
                "mem_gb": g.mem_gb,
                "mem_bw_tbps": g.mem_bw_tbps,
                "interconnect_gbps": g.interconnect_gbps,
            },
            "kv_capacity_tokens": self.pool.num_blocks * self.pool.block_size,
            "kv_bytes_per_token": self.profile.model.kv_bytes_per_token,
            "kv_scale": self.kv_scale,
            "speedup": self.pacer.speedup,
            "modelled_busy_s": round(self.pacer.charged_s, 6),
            "behind_s": round(self.pacer.lost_s, 6),
            "mixed_batches": self.config.mixed_batches,
        }

    def represented_bytes(self, payload: bytes) -> int:
        """The real KV bytes a payload stands for: its tokens x the profile's bytes per token,
        in the payload's format (as_format)."""
        header = read_kv_header(payload)
        real = format_bytes_per_token(self.profile.model.kv_bytes_per_token, header.dtype_name)
        return round(header.num_tokens * real)

    def step_time(self, new_tokens: list[int], context_tokens: list[int]) -> float:
        """Modelled seconds of one forward (pdd.hardware.forward_time on this unit)."""
        return forward_time(
            new_tokens, context_tokens, self.profile.model, self.gpu, self.profile.engine
        )

    # -- the parts of Engine that touch a model ------------------------------------------------

    def import_prefix(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        start_token: int,
        payload: bytes,
        *,
        recompute_missing: bool = False,
    ) -> ImportResult:
        result = super().import_prefix(
            request_id, prompt_ids, start_token, payload, recompute_missing=recompute_missing
        )
        # The received KV is copied into the pool over the unit's interconnect.
        real = result.received_tokens * self.profile.model.kv_bytes_per_token
        self.pacer.charge(transfer_time(real, self.gpu))
        return result

    def warm_prefix(self, token_ids: Sequence[int]) -> int:
        """Benchmarks only: put ``token_ids``'s whole blocks in the prefix cache at no modelled
        cost, as if an earlier request had left them there (a long-running fleet's cache at
        the start of a measured run). Evicts least-recently-used blocks if needed; returns the
        blocks newly cached (0 when the pool cannot make room)."""
        bs = self.cache.block_size
        whole = len(token_ids) // bs
        match = self.cache.match_prefix(token_ids[: whole * bs])
        have = len(match.blocks)
        need = whole - have
        if need <= 0:
            return 0
        self.cache.lock(match.node)  # what is already cached stays while room is made
        try:
            if not self.scheduler.reserve(need):
                return 0
            blocks = match.blocks + self.pool.allocate(need)
        finally:
            self.cache.unlock(match.node)
        result = self.cache.insert(token_ids[: whole * bs], blocks)
        self.pool.free(result.duplicates)
        return result.new_blocks

    def _step_once(self) -> list[TokenOutput] | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        contexts = [r.cached_len for r in batch.requests]
        seconds = self.step_time(list(batch.num_tokens), contexts)
        self.steps.append(
            StepRecord(
                "decode" if batch.is_decode else "extend",
                len(batch.requests),
                sum(batch.num_tokens),
                sum(contexts),
                seconds,
            )
        )
        self.pacer.charge(seconds, continuous=self._busy)
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            req.cached_len += n
        self._forwards += 1
        self._tokens_computed += sum(batch.num_tokens)
        complete = [r for r in batch.requests if r.extend_len == 0]
        sampled = [i for i, r in enumerate(complete) if r.after_forward != AfterForward.HOLD]
        tokens = [self._next_token(complete[i]) for i in sampled]
        # The emulated model is certain of its token: probability 1.
        logprobs = {
            i: TokenLogprob(0.0, ((token, 0.0),) if complete[i].sampling.logprobs else ())
            for i, token in zip(sampled, tokens, strict=True)
            if complete[i].sampling.logprobs is not None
        }
        outputs = self._deliver(complete, sampled, tokens, logprobs)
        # Whether the next forward follows this one back to back (the pacer's catch-up).
        self._busy = self.scheduler.has_work()
        return outputs

    def _next_token(self, req: Request) -> int:
        ctx = self._contexts.get(req.request_id)
        if ctx is None or ctx.hashed > len(req.token_ids):
            ctx = self._contexts[req.request_id] = _Context(hashlib.blake2b(digest_size=8))
        if ctx.hashed < len(req.token_ids):
            ctx.digest.update(array("I", req.token_ids[ctx.hashed :]).tobytes())
            ctx.hashed = len(req.token_ids)
        seed = None
        if not req.sampling.greedy:
            seed = req.generator.getrandbits(63) if req.generator is not None else 0
        return token_of(ctx.digest.digest(), seed)

    def _generator(self, sampling: SamplingParams, arrival: int) -> Any:
        if sampling.greedy:
            return None
        return random.Random(self._sampling_seed(sampling, arrival))

    def _finish(self, req: Request, reason: str) -> None:
        super()._finish(req, reason)
        self._contexts.pop(req.request_id, None)
