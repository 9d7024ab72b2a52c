"""Radix prefix cache over token ids at KV-block granularity: the decode-side RadixCache (DRC)
and the prefill side's own prefix cache. Only whole blocks are cached."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from pdd.prefix import chain_hashes


class TreeNode:
    """An edge of the tree: `key` is a whole number of blocks' worth of token ids."""

    __slots__ = ("parent", "children", "key", "blocks", "lock_ref", "last_access", "hashes")

    def __init__(
        self,
        parent: TreeNode | None = None,
        key: tuple[int, ...] = (),
        blocks: list[int] | None = None,
    ) -> None:
        self.parent = parent
        # Children are keyed by their first block of tokens: siblings never share a first block.
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.blocks = blocks if blocks is not None else []
        self.lock_ref = 0
        self.last_access = 0
        # The chain hash (pdd.prefix) of each block of the edge, when the cache publishes
        # events (RadixCache.enable_events); empty otherwise.
        self.hashes: list[bytes] = []

    @property
    def is_root(self) -> bool:
        return self.parent is None


class MatchResult(NamedTuple):
    blocks: list[int]  # cached blocks holding the matched prefix, in order
    matched_tokens: int  # == len(blocks) * block_size
    node: TreeNode  # deepest node holding a matched block; lock() it to protect all of them


class InsertResult(NamedTuple):
    duplicates: list[int]  # given blocks whose tokens were already cached: the caller frees them
    new_blocks: int  # given blocks the cache took ownership of
    node: TreeNode  # node holding the last inserted block (root if none)


class StoredEvent(NamedTuple):
    """Blocks entered the cache: ``hashes`` (chain hashes, in prefix order) continue the chain
    after ``parent`` (b"" at the start of a prompt)."""

    parent: bytes
    hashes: list[bytes]


class RemovedEvent(NamedTuple):
    """Blocks left the cache (evicted)."""

    hashes: list[bytes]


class CacheStats(NamedTuple):
    lookups: int
    hits: int  # lookups that matched at least one block
    queried_tokens: int
    matched_tokens: int
    cached_blocks: int
    locked_blocks: int

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache."""
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache(ABC):
    """Interface of a prefix cache; each docstring says whether the call mutates it."""

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Read-only: longest cached whole-block prefix of `tokens` (LRU order is untouched)."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Mutates: pin `node` and its ancestors against eviction and mark them recently used."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Mutates: drop one pin taken by `lock(node)`."""

    @abstractmethod
    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> InsertResult:
        """Mutates: cache the whole blocks of `tokens` (block i holds tokens[i*bs:(i+1)*bs])."""

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Mutates: drop least-recently-used unpinned leaves until `num_blocks` blocks are
        released or none is left; returns the released blocks for the caller to free."""

    @abstractmethod
    def record_lookup(self, queried_tokens: int, matched_tokens: int) -> None:
        """Mutates the statistics only: count one lookup on behalf of a request."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Read-only: counters and sizes."""


class RadixCache(PrefixCache):
    """Radix tree whose edges are runs of whole blocks; LRU eviction of unpinned leaves."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)  # logical time: deterministic LRU, no wall clock
        self._cached_blocks = 0
        self._locked_blocks = 0
        self._lookups = self._hits = self._queried = self._matched = 0
        # What entered and left the cache since the last drain_events(), when enabled.
        self._events: list[StoredEvent | RemovedEvent] | None = None

    # -- KV cache events ----------------------------------------------------------------------

    def enable_events(self) -> None:
        """Mutates: from now on, keep every block's chain hash and record what enters and leaves
        the cache (drain_events). Blocks already cached are recorded as stored."""
        if self._events is not None:
            return
        self._events = []
        stack = [(child, b"") for child in self.root.children.values()]
        while stack:
            node, parent = stack.pop()
            node.hashes = chain_hashes(parent, node.key, self.block_size)
            self._events.append(StoredEvent(parent, list(node.hashes)))
            stack.extend((child, node.hashes[-1]) for child in node.children.values())

    def drain_events(self) -> list[StoredEvent | RemovedEvent]:
        """Mutates: the events recorded since the last call, oldest first (empty when events are
        not enabled)."""
        events, self._events = self._events, ([] if self._events is not None else None)
        return events or []

    def held_hashes(self) -> list[tuple[bytes, list[bytes]]]:
        """Read-only: every cached edge as (parent hash, its block hashes), parents before their
        children: a full snapshot for a subscriber that lost track. Needs events enabled."""
        out: list[tuple[bytes, list[bytes]]] = []
        stack = [(child, b"") for child in self.root.children.values()]
        while stack:
            node, parent = stack.pop()
            out.append((parent, list(node.hashes)))
            stack.extend((child, node.hashes[-1]) for child in node.children.values())
        return out

    def _first_block(self, tokens: Sequence[int], offset: int) -> tuple[int, ...]:
        return tuple(tokens[offset : offset + self.block_size])

    def _common_blocks(self, key: tuple[int, ...], tokens: Sequence[int], offset: int) -> int:
        """Number of leading whole blocks that `key` shares with tokens[offset:]."""
        bs = self.block_size
        n = 0
        while (n + 1) * bs <= len(key) and offset + (n + 1) * bs <= len(tokens):
            lo = n * bs
            if key[lo : lo + bs] != tuple(tokens[offset + lo : offset + lo + bs]):
                break
            n += 1
        return n

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        bs = self.block_size
        node, offset, blocks = self.root, 0, []
        while offset + bs <= len(tokens):
            child = node.children.get(self._first_block(tokens, offset))
            if child is None:
                break
            n = self._common_blocks(child.key, tokens, offset)
            assert n >= 1, "a child is indexed by its first block, so it matches at least one"
            blocks.extend(child.blocks[:n])
            offset += n * bs
            node = child
            if n * bs < len(child.key):
                break  # partial edge: `child` still protects the matched blocks when locked
        return MatchResult(blocks, offset, node)

    def lock(self, node: TreeNode) -> None:
        now = next(self._clock)
        while node is not None:
            if node.lock_ref == 0:
                self._locked_blocks += len(node.blocks)
            node.lock_ref += 1
            node.last_access = now
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_blocks -= len(node.blocks)
            node = node.parent

    def _split(self, child: TreeNode, num_blocks: int) -> TreeNode:
        """Cut `child`'s edge after `num_blocks` blocks; returns the new upper node."""
        bs = self.block_size
        upper = TreeNode(child.parent, child.key[: num_blocks * bs], child.blocks[:num_blocks])
        # Locks taken on `child` pass through the new upper node on their way to the root.
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.parent.children[upper.key[:bs]] = upper
        child.parent = upper
        child.key = child.key[num_blocks * bs :]
        child.blocks = child.blocks[num_blocks:]
        if child.hashes:
            upper.hashes, child.hashes = child.hashes[:num_blocks], child.hashes[num_blocks:]
        upper.children[child.key[:bs]] = child
        return upper

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> InsertResult:
        bs = self.block_size
        num_whole = min(len(tokens) // bs, len(blocks))
        tokens, blocks = list(tokens[: num_whole * bs]), list(blocks[:num_whole])
        now = next(self._clock)
        node, offset, duplicates, new_blocks = self.root, 0, [], 0
        while offset < len(tokens):
            node.last_access = now
            child = node.children.get(self._first_block(tokens, offset))
            if child is None:
                rest = blocks[offset // bs :]
                leaf = TreeNode(node, tuple(tokens[offset:]), rest)
                leaf.last_access = now
                node.children[leaf.key[:bs]] = leaf
                if self._events is not None:
                    parent = node.hashes[-1] if node.hashes else b""
                    leaf.hashes = chain_hashes(parent, leaf.key, bs)
                    self._events.append(StoredEvent(parent, list(leaf.hashes)))
                self._cached_blocks += len(rest)
                new_blocks += len(rest)
                node = leaf
                break
            n = self._common_blocks(child.key, tokens, offset)
            if n * bs < len(child.key):
                child = self._split(child, n)
            for i, held in enumerate(child.blocks):
                given = blocks[offset // bs + i]
                if given != held:  # the caller's own copy of a block already cached
                    duplicates.append(given)
            offset += n * bs
            node = child
        node.last_access = now
        return InsertResult(duplicates, new_blocks, node)

    def evict(self, num_blocks: int) -> list[int]:
        # Ties in logical time break on the first block id, which is unique, so order is stable.
        leaves = [(n.last_access, n.blocks[0], n) for n in self._iter_nodes() if self._evictable(n)]
        heapq.heapify(leaves)
        released: list[int] = []
        while leaves and len(released) < num_blocks:
            _, _, leaf = heapq.heappop(leaves)
            released.extend(leaf.blocks)
            if self._events is not None:
                self._events.append(RemovedEvent(leaf.hashes))
            self._cached_blocks -= len(leaf.blocks)
            parent = leaf.parent
            del parent.children[leaf.key[: self.block_size]]
            if self._evictable(parent):
                heapq.heappush(leaves, (parent.last_access, parent.blocks[0], parent))
        return released

    def _evictable(self, node: TreeNode) -> bool:
        return not node.is_root and not node.children and node.lock_ref == 0

    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def record_lookup(self, queried_tokens: int, matched_tokens: int) -> None:
        self._lookups += 1
        self._hits += matched_tokens > 0
        self._queried += queried_tokens
        self._matched += matched_tokens

    @property
    def evictable_blocks(self) -> int:
        """Read-only: blocks that `evict` could release now."""
        return self._cached_blocks - self._locked_blocks

    def stats(self) -> CacheStats:
        return CacheStats(
            self._lookups,
            self._hits,
            self._queried,
            self._matched,
            self._cached_blocks,
            self._locked_blocks,
        )
