"""The prefix index: which KV blocks each decode instance's prefix cache holds, kept from its
agent's KV cache events (agents/node/kv_events.py, docs/PROTOCOL.md "KV cache events") and read
by every gateway's policy.

An instance's entry is its epoch (one per engine start), the last batch applied and the set of
block hashes it holds. A batch applies when it follows the last one (same epoch, next number)
or starts with "cleared" (a fresh engine, or a snapshot after a resync); a batch already applied
is skipped (the agent retried after a lost answer); anything else, or a digest (block count and
XOR of the hashes) that differs after a batch, is answered "resync", and the agent sends a
snapshot of its cache. Nothing is capped: an instance may hold millions of blocks.

Where it lives: this process's memory on the embedded defaults. With ``REDIS_URL`` set, the
index is in Redis (per instance a set of 8-byte hashes and its epoch / batch / digest, under
one lock per instance while a batch applies; a batch's changes go to the set in one Lua script
call, each run of hashes packed in one argument) and every applied batch is appended to a Redis
stream (each run of hashes as the hex of its packed 8-byte members); each process keeps a
mirror in memory that reads only the stream's new entries, so a gateway's lookups never leave
the process, and reloads an instance from its set when the stream was trimmed past what the
mirror has seen.

Memory: a held block costs about 70 bytes in a process's mirror (a 64-bit int in a set) and
about 60-70 bytes in Redis (an 8-byte member of a set); 1.5M blocks, an H200 main decoder's
cache at ~4 KB per token, is ~100 MB.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import operator
import sys
import threading
import time
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100_000  # entries kept in the Redis stream (approximate trim)
READ_BATCH = 500  # stream entries per XREAD
LOCK_TTL_S = 30


class IndexError_(ValueError):
    """A malformed event batch (the API answers 400 naming the field)."""


def parse_hash(value: Any, where: str) -> int:
    if not isinstance(value, str) or len(value) != 16:
        raise IndexError_(f"{where}: must be a 16-character hex block hash, got {value!r:.40}")
    try:
        return int(value, 16)
    except ValueError:
        raise IndexError_(
            f"{where}: must be a 16-character hex block hash, got {value!r:.40}"
        ) from None


_WORD = "Q" if array("Q").itemsize == 8 else "L"

# One batch's changes on an instance's set of 8-byte hashes, in one round trip: ARGV holds
# (sign, members packed end to end) pairs; for each pair SMISMEMBER then SADD or SREM, in
# slices that stay under Lua's limit on unpacked arguments. The reply: per pair a string of
# "0" / "1", whether each member was there before, and then the set's size. The caller packs
# a 4,096-block change as one argument instead of 4,096 twice (SMISMEMBER, then SADD), which
# cost the web process more than the commands cost Redis.
_CHANGES_LUA = """
local key = KEYS[1]
local out = {}
for p = 1, #ARGV, 2 do
  local add = tonumber(ARGV[p]) > 0
  local packed = ARGV[p + 1]
  local n = #packed / 8
  local flags = {}
  local i = 0
  while i < n do
    local stop = math.min(n, i + 4000)
    local members = {}
    for j = i, stop - 1 do
      members[#members + 1] = string.sub(packed, j * 8 + 1, j * 8 + 8)
    end
    local was = redis.call('SMISMEMBER', key, unpack(members))
    for k = 1, #was do
      flags[#flags + 1] = was[k] == 1 and '1' or '0'
    end
    if add then
      redis.call('SADD', key, unpack(members))
    else
      redis.call('SREM', key, unpack(members))
    end
    i = stop
  end
  out[#out + 1] = table.concat(flags)
end
out[#out + 1] = redis.call('SCARD', key)
return out
"""
# Flags (bytes of "0" / "1") to 1 where an add or a remove changed the set.
_ADDED = bytes.maketrans(b"01", b"\x01\x00")
_REMOVED = bytes.maketrans(b"01", b"\x00\x01")


def _unpack(hashes: str | list[int]) -> tuple[int, ...]:
    """A stream entry's run of hashes: hex of packed members, or (entries an older version
    wrote) a list of integers."""
    if isinstance(hashes, list):
        return tuple(hashes)
    return _from_members(bytes.fromhex(hashes))


def _from_members(raw: bytes) -> tuple[int, ...]:
    """8-byte big-endian members end to end as integers (one C pass)."""
    words = array(_WORD)
    words.frombytes(raw)
    if sys.byteorder == "little":
        words.byteswap()
    return tuple(words.tolist())


def _members(hashes: Sequence[int]) -> bytes:
    """Hashes as 8-byte big-endian members, end to end (one C pass)."""
    words = array(_WORD, hashes)
    if sys.byteorder == "little":
        words.byteswap()
    return words.tobytes()


def parse_hashes(values: list[Any], where: str) -> tuple[int, ...]:
    """A list of 16-character hex block hashes as integers. In bulk (one hex decode, one array:
    a 4,096-block event in ~0.2 ms instead of ~2 ms one by one); anything else goes through
    ``parse_hash`` one by one, for the error naming the bad value."""
    try:
        joined = "".join(values)
        raw = bytes.fromhex(joined)
    except (TypeError, ValueError):
        raw = b""
    if values and len(raw) == 8 * len(values) and set(map(len, values)) == {16}:
        return _from_members(raw)
    return tuple(parse_hash(h, where) for h in values)


@dataclass(frozen=True, slots=True)
class Batch:
    """One numbered batch, parsed: ``cleared`` first (if any), then (+1 / -1, hashes) runs."""

    seq: int
    cleared: bool
    changes: tuple[tuple[int, tuple[int, ...]], ...]
    digest_blocks: int | None
    digest_xor: int | None

    def to_json(self) -> str:
        return json.dumps(
            {
                "seq": self.seq,
                "cleared": self.cleared,
                # Each run's hashes as the hex of their 8-byte members end to end: encoded
                # and decoded in C (a list of 4,096 integers was ~1 ms each way, and every
                # gateway process decodes every batch).
                "changes": [[sign, _members(hashes).hex()] for sign, hashes in self.changes],
                "digest": [self.digest_blocks, self.digest_xor],
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Batch:
        doc = json.loads(raw)
        blocks, xor = doc["digest"]
        return cls(
            int(doc["seq"]),
            bool(doc["cleared"]),
            tuple((int(s), _unpack(h)) for s, h in doc["changes"]),
            blocks,
            xor,
        )


def parse_batch(doc: Any, where: str) -> Batch:
    """A batch as the agent posts it ({"seq", "events", "digest"}), checked."""
    if not isinstance(doc, dict):
        raise IndexError_(f"{where}: must be an object")
    seq = doc.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise IndexError_(f"{where}.seq: must be an integer >= 1")
    events = doc.get("events")
    if not isinstance(events, list):
        raise IndexError_(f"{where}.events: must be a list")
    cleared = False
    changes: list[tuple[int, tuple[int, ...]]] = []
    for i, event in enumerate(events):
        at = f"{where}.events[{i}]"
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "cleared":
            if i != 0:
                raise IndexError_(f"{at}: 'cleared' may only open a batch")
            cleared = True
            continue
        if kind not in ("stored", "removed"):
            raise IndexError_(f"{at}.type: must be 'stored', 'removed' or 'cleared'")
        blocks = event.get("blocks")
        if not isinstance(blocks, list):
            raise IndexError_(f"{at}.blocks: must be a list of block hashes")
        if kind == "stored" and event.get("parent") is not None:
            parse_hash(event.get("parent"), f"{at}.parent")
        hashes = parse_hashes(blocks, f"{at}.blocks")
        changes.append((1 if kind == "stored" else -1, hashes))
    digest = doc.get("digest")
    d_blocks = d_xor = None
    if digest is not None:
        if not isinstance(digest, dict):
            raise IndexError_(f"{where}.digest: must be an object")
        d_blocks = digest.get("blocks")
        if not isinstance(d_blocks, int) or isinstance(d_blocks, bool) or d_blocks < 0:
            raise IndexError_(f"{where}.digest.blocks: must be an integer >= 0")
        d_xor = parse_hash(digest.get("xor"), f"{where}.digest.xor")
    return Batch(seq, cleared, tuple(changes), d_blocks, d_xor)


class HeldBlocks(Collection[str]):
    """What the policy sees of an instance's cache: ``hex_hash in held``. A read-only view of
    the index's set (plus ``extra`` hashes, e.g. KV in flight); no copy per view."""

    __slots__ = ("_blocks", "_extra")

    def __init__(self, blocks: Collection[int] = frozenset(), extra: Iterable[str] = ()) -> None:
        self._blocks = blocks
        self._extra = frozenset(extra)

    def __contains__(self, item: object) -> bool:
        if item in self._extra:
            return True
        if not isinstance(item, str) or len(item) != 16:
            return False
        try:
            return int(item, 16) in self._blocks
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._blocks) + len(self._extra)

    def __iter__(self) -> Iterator[str]:
        yield from self._extra
        for h in list(self._blocks):
            yield f"{h:016x}"

    def __bool__(self) -> bool:
        return bool(self._blocks) or bool(self._extra)

    def union(self, *others: Iterable[str]) -> HeldBlocks:
        return HeldBlocks(self._blocks, self._extra.union(*others))

    def __repr__(self) -> str:
        return f"HeldBlocks({len(self._blocks)} indexed, {len(self._extra)} extra)"


@dataclass
class Entry:
    epoch: str
    seq: int = 0
    blocks: set[int] = field(default_factory=set)
    xor: int = 0
    updated_at: float = 0.0


class MemoryIndex:
    """The index in this process's memory (the embedded default, and each process's mirror of
    the Redis index)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()

    def state(self, instance_id: str) -> tuple[str, int] | None:
        entry = self.entries.get(instance_id)
        return None if entry is None else (entry.epoch, entry.seq)

    def apply_batch(self, instance_id: str, epoch: str, batch: Batch) -> str | None:
        """Apply one batch; None when applied (or already applied), else why a resync."""
        with self.lock:
            entry = self.entries.get(instance_id)
            if batch.cleared:
                entry = self.entries[instance_id] = Entry(epoch, batch.seq - 1)
            elif entry is None:
                return "the index holds nothing for this instance"
            elif entry.epoch != epoch:
                return f"epoch {epoch} is not the indexed one"
            elif batch.seq <= entry.seq:
                return None  # already applied: a retry after a lost answer
            elif batch.seq != entry.seq + 1:
                return f"batch {batch.seq} does not follow batch {entry.seq}"
            blocks, xor = entry.blocks, entry.xor
            for sign, hashes in batch.changes:
                if sign > 0:
                    for h in hashes:
                        if h not in blocks:
                            blocks.add(h)
                            xor ^= h
                else:
                    for h in hashes:
                        if h in blocks:
                            blocks.discard(h)
                            xor ^= h
            entry.xor, entry.seq, entry.updated_at = xor, batch.seq, time.time()
            if batch.digest_blocks is not None and (
                batch.digest_blocks != len(blocks) or batch.digest_xor != xor
            ):
                return (
                    f"digest differs after batch {batch.seq}: index {len(blocks)} blocks, "
                    f"agent {batch.digest_blocks}"
                )
            return None

    def replace(self, instance_id: str, epoch: str, seq: int, blocks: set[int]) -> None:
        xor = 0
        for h in blocks:
            xor ^= h
        with self.lock:
            self.entries[instance_id] = Entry(epoch, seq, blocks, xor, time.time())

    def held(self, instance_id: str) -> Collection[int]:
        entry = self.entries.get(instance_id)
        return entry.blocks if entry is not None else frozenset()

    def forget(self, instance_id: str) -> None:
        with self.lock:
            self.entries.pop(instance_id, None)

    def stats(self) -> dict[str, int]:
        return {iid: len(e.blocks) for iid, e in list(self.entries.items())}


class PrefixIndex:
    """The index as the API and the gateways use it (memory, or Redis with a local mirror)."""

    def __init__(self, redis_url: str | None = None, prefix: str = "baton") -> None:
        self.redis_url = redis_url
        self.prefix = f"{prefix}:kv"
        self.local = MemoryIndex()
        self._client: Any = None
        self._script: Any = None
        self._last_id = "0-0"
        self._sync_lock = threading.Lock()
        self._synced_at = 0.0

    # -- Redis plumbing -----------------------------------------------------------------------

    def _redis(self) -> Any:
        if self._client is None:
            import redis

            assert self.redis_url, "only with REDIS_URL"
            self._client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        return self._client

    def _key(self, instance_id: str, what: str) -> str:
        return f"{self.prefix}:{instance_id}:{what}"

    def _changes_script(self) -> Any:
        if self._script is None:
            self._script = self._redis().register_script(_CHANGES_LUA)
        return self._script

    # -- writing (the agent API) --------------------------------------------------------------

    def apply(
        self, instance_id: str, epoch: str, seq: int, batches: Sequence[Batch]
    ) -> dict[str, Any]:
        """Apply an agent's batches in order; the answer: ``acked`` (the last batch the index
        holds) and, when it cannot go on, ``resync`` with the reason."""
        if self.redis_url:
            return self._apply_redis(instance_id, epoch, seq, batches)
        for batch in batches:
            reason = self.local.apply_batch(instance_id, epoch, batch)
            if reason is not None:
                return self._answer(self.local.state(instance_id), epoch, reason)
        return self._answer(self.local.state(instance_id), epoch, None, seq)

    @staticmethod
    def _answer(
        state: tuple[str, int] | None, epoch: str, reason: str | None, seq: int | None = None
    ) -> dict[str, Any]:
        if reason is None and seq is not None:
            # A keep-alive (or the last batch): the index must be where the agent says.
            if state is None or state[0] != epoch:
                reason = "the index holds nothing for this epoch"
            elif state[1] > seq:
                reason = f"the index is at batch {state[1]}, past the agent's {seq}"
        answer: dict[str, Any] = {"acked": state[1] if state and state[0] == epoch else 0}
        if reason is not None:
            answer |= {"resync": True, "reason": reason}
        return answer

    def _apply_redis(
        self, instance_id: str, epoch: str, seq: int, batches: Sequence[Batch]
    ) -> dict[str, Any]:
        r = self._redis()
        lock = r.lock(self._key(instance_id, "lock"), timeout=LOCK_TTL_S, blocking_timeout=5)
        if not lock.acquire():
            return {"acked": 0, "busy": True}
        try:
            meta = r.hgetall(self._key(instance_id, "meta"))
            state = (meta[b"epoch"].decode(), int(meta[b"seq"])) if meta else None
            xor = int(meta[b"xor"]) if meta else 0
            blocks_key = self._key(instance_id, "blocks")
            for batch in batches:
                if batch.cleared:
                    r.delete(blocks_key)
                    state, xor = (epoch, batch.seq - 1), 0
                elif state is None:
                    return self._answer(None, epoch, "the index holds nothing for this instance")
                elif state[0] != epoch:
                    return self._answer(state, epoch, f"epoch {epoch} is not the indexed one")
                elif batch.seq <= state[1]:
                    continue
                elif batch.seq != state[1] + 1:
                    reason = f"batch {batch.seq} does not follow batch {state[1]}"
                    return self._answer(state, epoch, reason)
                changes = [(sign, hashes) for sign, hashes in batch.changes if hashes]
                *flags, count = self._changes_script()(
                    keys=[blocks_key],
                    args=[arg for sign, hashes in changes for arg in (sign, _members(hashes))],
                )
                for (sign, hashes), was in zip(changes, flags, strict=True):
                    # A hash whose presence the change flipped enters the digest.
                    flipped = was.translate(_ADDED if sign > 0 else _REMOVED)
                    xor = functools.reduce(operator.xor, itertools.compress(hashes, flipped), xor)
                state = (epoch, batch.seq)
                r.hset(
                    self._key(instance_id, "meta"),
                    mapping={"epoch": epoch, "seq": batch.seq, "xor": xor},
                )
                r.xadd(
                    f"{self.prefix}:stream",
                    {"instance": instance_id, "epoch": epoch, "batch": batch.to_json()},
                    maxlen=STREAM_MAXLEN,
                    approximate=True,
                )
                if batch.digest_blocks is not None and (
                    batch.digest_blocks != count or batch.digest_xor != xor
                ):
                    reason = (
                        f"digest differs after batch {batch.seq}: index {count} blocks, "
                        f"agent {batch.digest_blocks}"
                    )
                    return self._answer(state, epoch, reason)
            return self._answer(state, epoch, None, seq)
        finally:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - expired: the next writer took it over
                log.warning("prefix index lock of %s expired while applying", instance_id)

    def forget(self, instance_id: str) -> None:
        """An instance that no longer runs: its entry goes."""
        self.local.forget(instance_id)
        if self.redis_url:
            try:
                self._redis().delete(
                    self._key(instance_id, "meta"), self._key(instance_id, "blocks")
                )
            except Exception:  # noqa: BLE001 - a stale entry is harmless (never healthy)
                log.warning("prefix index: could not forget %s", instance_id)

    # -- reading (the gateways) ---------------------------------------------------------------

    def sync(self, *, min_gap_s: float = 0.0) -> None:
        """Bring this process's mirror up to date with the Redis stream (a no-op in memory)."""
        if not self.redis_url:
            return
        now = time.monotonic()
        if now - self._synced_at < min_gap_s:
            return
        with self._sync_lock:
            self._synced_at = now
            try:
                self._sync_redis()
            except Exception:  # noqa: BLE001 - route on the mirror as it is
                log.exception("prefix index: reading the event stream failed")

    def _sync_redis(self) -> None:
        r = self._redis()
        stream = f"{self.prefix}:stream"
        if self._last_id == "0-0" or self._trimmed_past(r, stream):
            self._reload(r, stream)
        while True:
            got = r.xread({stream: self._last_id}, count=READ_BATCH)
            if not got:
                return
            entries = got[0][1]
            for entry_id, fields in entries:
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                iid = fields[b"instance"].decode()
                epoch = fields[b"epoch"].decode()
                batch = Batch.from_json(fields[b"batch"])
                if self.local.apply_batch(iid, epoch, batch) is not None:
                    self._reload_one(r, iid)
            if len(entries) < READ_BATCH:
                return

    def _trimmed_past(self, r: Any, stream: str) -> bool:
        first = r.xrange(stream, count=1)
        if not first:
            return False
        first_id = first[0][0].decode()
        return _id_tuple(first_id) > _id_tuple(self._last_id) and self._last_id != "0-0"

    def _reload(self, r: Any, stream: str) -> None:
        """Every instance from its set (a new mirror, or one the stream's trim left behind)."""
        last = r.xrevrange(stream, count=1)
        self._last_id = last[0][0].decode() if last else "0-0"
        if self._last_id == "0-0":
            self._last_id = "0-1"  # an empty stream: read from the start from now on
        for key in r.scan_iter(match=f"{self.prefix}:*:meta", count=1000):
            iid = key.decode()[len(self.prefix) + 1 : -len(":meta")]
            self._reload_one(r, iid)

    def _reload_one(self, r: Any, instance_id: str) -> None:
        meta = r.hgetall(self._key(instance_id, "meta"))
        if not meta:
            self.local.forget(instance_id)
            return
        members = r.smembers(self._key(instance_id, "blocks"))
        blocks = {int.from_bytes(m, "big") for m in members}
        self.local.replace(instance_id, meta[b"epoch"].decode(), int(meta[b"seq"]), blocks)

    def held(self, instance_id: str, extra: Iterable[str] = ()) -> HeldBlocks:
        """The instance's blocks as the policy reads them (the mirror; sync() first)."""
        return HeldBlocks(self.local.held(instance_id), extra)

    def stats(self) -> dict[str, int]:
        return self.local.stats()


def _id_tuple(stream_id: str) -> tuple[int, int]:
    ms, _, n = stream_id.partition("-")
    return int(ms), int(n or 0)


_index: PrefixIndex | None = None
_index_lock = threading.Lock()


def prefix_index() -> PrefixIndex:
    """This process's prefix index (Redis-backed when REDIS_URL is set)."""
    global _index
    with _index_lock:
        if _index is None or _index.redis_url != (settings.REDIS_URL or None):
            _index = PrefixIndex(
                settings.REDIS_URL or None, getattr(settings, "REDIS_KEY_PREFIX", "baton")
            )
        return _index
