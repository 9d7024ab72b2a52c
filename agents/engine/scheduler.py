"""Continuous-batching scheduler: admits queued requests against running-slot and KV-block
budgets (reusing radix-cached prefixes), and picks each step's batch: extends first, else one
decode token for every running request. With ``EngineConfig.mixed_batches`` the running
decodes ride along with the extends (one position each, ahead of them in the token budget),
so a long extend (a prompt's chunk, the handoff's k tokens at a long context) does not hold
every decoding request's next token back for its whole length."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from agents.engine.config import EngineConfig
from agents.engine.errors import EngineFull
from agents.engine.kv_pool import KVPool
from agents.engine.radix_cache import RadixCache
from agents.engine.request import Request, RequestStatus


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    num_tokens: list[int]  # new positions run for each request (a prompt may be chunked)
    is_decode: bool  # every request runs exactly one position


class Scheduler:
    """Owns the waiting queue, the running list and every request's KV blocks and pins."""

    def __init__(self, config: EngineConfig, pool: KVPool, cache: RadixCache) -> None:
        assert pool.block_size == cache.block_size, "pool and cache must agree on block size"
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a new request. Raises EngineFull when the queue is at max_queued."""
        need = self.pool.blocks_for(req.device_len + req.sampling.max_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id} needs up to {need} KV blocks; the pool has "
                f"{self.pool.num_blocks}"
            )
        if len(self.waiting) >= self.config.max_queued:
            raise EngineFull(f"engine queue is full ({self.config.max_queued} waiting requests)")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def resume(self, req: Request) -> None:
        """Put a held request (KV present) back in line ahead of new arrivals."""
        assert req.status == RequestStatus.HELD, f"{req.request_id} is {req.status}, not held"
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- KV blocks ---------------------------------------------------------------------------

    def reserve(self, num_blocks: int) -> bool:
        """Make `num_blocks` free, evicting unpinned radix leaves only if that suffices."""
        short = num_blocks - self.pool.num_free_blocks
        if short <= 0:
            return True
        if short > self.cache.evictable_blocks:
            return False
        self.pool.free(self.cache.evict(short))
        return self.pool.num_free_blocks >= num_blocks

    def grow(self, req: Request, num_positions: int) -> bool:
        """Extend req's block table to hold `num_positions` positions."""
        need = self.pool.blocks_for(num_positions) - len(req.block_table)
        if need <= 0:
            return True
        if not self.reserve(need):
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    def pin_prefix(self, req: Request) -> int:
        """Point req at the longest cached whole-block prefix of its tokens and pin it.

        At least one position is left to run, since the next token needs the logits of the
        last one; returns the number of reused positions."""
        assert not req.block_table and req.cache_node is None, "request already holds KV"
        match = self.cache.match_prefix(req.token_ids)
        usable = min(len(match.blocks), (req.device_len - 1) // self.pool.block_size)
        self.cache.lock(match.node)
        req.cache_node = match.node
        req.block_table = list(match.blocks[:usable])
        req.cached_len = req.shared_len = usable * self.pool.block_size
        return req.cached_len

    def release(self, req: Request, keep_in_cache: bool = True) -> None:
        """Give back req's KV: whole computed blocks go to the radix cache (so a later turn or a
        re-admission hits), everything else returns to the pool, and its pin is dropped."""
        assert req.cached_len >= req.shared_len, "pinned positions always have KV"
        bs = self.pool.block_size
        table = req.block_table
        if keep_in_cache:
            keep = req.cached_len // bs
            self.pool.free(self.cache.insert(req.token_ids[: keep * bs], table[:keep]).duplicates)
        else:
            keep = req.shared_len // bs  # those blocks belong to the cache already
        self.pool.free(table[keep:])
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.block_table, req.cache_node = [], None
        req.cached_len = req.shared_len = 0

    def share_computed(self, req: Request) -> list[int]:
        """Insert req's computed whole blocks into the radix cache now and pin them there.

        Where the cache already held some of those blocks, req switches to the cached copies;
        returns req's own copies that became redundant (already freed)."""
        bs = self.pool.block_size
        whole = req.cached_len // bs
        tokens = req.token_ids[: whole * bs]
        result = self.cache.insert(tokens, req.block_table[:whole])
        match = self.cache.match_prefix(tokens)
        assert match.matched_tokens == whole * bs, "blocks just inserted must match"
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = match.node
        req.block_table[:whole] = match.blocks
        req.shared_len = whole * bs
        self.pool.free(result.duplicates)
        return result.duplicates

    def hold(self, req: Request) -> None:
        """Take a running request out of the batch; its KV stays."""
        self.running.remove(req)
        req.status = RequestStatus.HELD

    # -- scheduling --------------------------------------------------------------------------

    def _admit(self, req: Request) -> bool:
        fresh = not req.block_table
        if fresh:
            matched = self.pin_prefix(req)
        if not self.grow(req, req.device_len):
            if fresh:
                self.release(req, keep_in_cache=False)
            return False
        if fresh:
            self.cache.record_lookup(req.device_len, matched)
            if req.prompt_matched_tokens == 0:
                req.prompt_matched_tokens = matched
        return True

    def _admit_waiting(self) -> None:
        budget = self.config.max_batch_tokens
        while self.waiting and len(self.running) < self.config.max_running and budget > 0:
            req = self.waiting[0]
            if not self._admit(req):
                break  # FCFS: later requests wait behind the head until blocks free up
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= req.extend_len

    def preempt(self, req: Request) -> None:
        """Stop a running request and queue it at the front; its computed whole blocks stay in
        the radix cache, so re-admission usually recomputes only the tail."""
        self.running.remove(req)
        self.release(req, keep_in_cache=True)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next forward's requests and positions; None when nothing can run."""
        self._admit_waiting()
        extends = [r for r in self.running if r.extend_len > 1]
        if not extends:
            candidates = sorted(self.running, key=lambda r: r.arrival)
        elif self.config.mixed_batches:
            decodes = [r for r in self.running if r.extend_len == 1]
            candidates = sorted(decodes, key=lambda r: r.arrival)
            candidates += sorted(extends, key=lambda r: r.arrival)
        else:
            candidates = sorted(extends, key=lambda r: r.arrival)
        budget = self.config.max_batch_tokens
        batch, counts = [], []
        for req in candidates:
            assert req.extend_len >= 1, f"running request {req.request_id} has nothing to run"
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted below to make room for an earlier request
            n = min(req.extend_len, budget)
            while not self.grow(req, req.cached_len + n):
                victim = max(self.running, key=lambda r: r.arrival)
                self.preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            batch.append(req)
            counts.append(n)
            budget -= n
        if not batch:
            return None
        return ScheduledBatch(batch, counts, is_decode=not extends)

    def finish(self, req: Request, reason: str) -> None:
        """Mark req finished and cache its prompt + output KV."""
        if req in self.running:
            self.running.remove(req)
        if req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.release(req, keep_in_cache=True)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
