"""What this gateway process has dispatched, which the agents' reports do not show yet: the
requests in flight per instance (``DispatchLedger``, added to the live view's load by
``with_dispatches``) and the prefix blocks sent to each MD (``DispatchedBlocks``, counted as
held there by ``with_dispatched_blocks``). Both are shared by every gateway process through
Redis when REDIS_URL is set (``RedisFallback``: this process's memory while Redis is down)."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from itertools import takewhile
from typing import Any

from pdd.policy import ClusterSnapshot, InstanceState, leading_run
from routing.live import LiveView

log = logging.getLogger(__name__)


REDIS_RETRY_S = 10.0  # how long the dispatch ledger counts locally after a Redis failure


class RedisFallback:
    """A ledger's Redis upkeep: after a failure it skips Redis for REDIS_RETRY_S (no timeout
    on every request while Redis is down) and warns at most once a minute."""

    _name = "ledger"
    # redis.Redis when shared (its stubs type each reply as Awaitable | value: read as Any).
    _redis: Any = None
    _redis_down_until = 0.0
    _warned_at = 0.0

    def _connect(self, redis_url: str) -> None:
        """Redis with short timeouts when `redis_url` is set (a slow Redis must not hold a
        request up), else none: this process's memory only. After a failure Redis is skipped
        for a while (no timeout on every request while it is down)."""
        self._redis = None
        self._warned_at = 0.0
        self._redis_down_until = 0.0
        if redis_url:
            import redis

            self._redis = redis.Redis.from_url(
                redis_url, socket_connect_timeout=0.5, socket_timeout=0.5
            )

    def _use_redis(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_down_until

    def _redis_failed(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        self._redis_down_until = now + REDIS_RETRY_S
        if now - self._warned_at > 60:  # once a minute, not once a request
            self._warned_at = now
            log.warning(
                "%s: Redis %s failed (%s); counting this process's dispatches only",
                self._name, what, exc,
            )  # fmt: skip


class DispatchLedger(RedisFallback):
    """Requests the gateway has routed to each instance, by wall time.

    An agent reports its load every couple of seconds, so every decision between two reports
    would see the same loads and pick the same least-loaded instance (a herd). The gateway
    therefore adds what it has routed to an instance since that instance's last report (see
    :func:`with_dispatches`). Entries older than ``horizon_s`` are forgotten.

    With ``redis_url`` the ledger is shared by every gateway process (a sorted set of dispatch
    times per instance), so several workers do not herd either. This process's own dispatches
    are always kept in memory as well: if Redis fails, the ledger logs it and counts those.
    """

    _name = "dispatch ledger"

    def __init__(
        self, horizon_s: float = 30.0, redis_url: str = "", *, prefix: str = "baton:dispatch"
    ) -> None:
        self.horizon_s = horizon_s
        self.prefix = prefix
        self._times: dict[str, deque[float]] = {}
        self._lock = threading.Lock()
        self._connect(redis_url)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def record(self, instance_ids: Iterable[str | None], now: float | None = None) -> None:
        now = time.time() if now is None else now
        ids = [iid for iid in instance_ids if iid]
        with self._lock:
            for iid in ids:
                times = self._times.setdefault(iid, deque())
                times.append(now)
                while times and times[0] < now - self.horizon_s:
                    times.popleft()
        if self._use_redis() and ids:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid in ids:
                    key = f"{self.prefix}:{iid}"
                    pipe.zadd(key, {f"{now:.6f}:{uuid.uuid4().hex[:12]}": now})
                    pipe.zremrangebyscore(key, "-inf", now - self.horizon_s)
                    pipe.expire(key, int(self.horizon_s * 2) + 1)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("record", exc)

    def since(self, instance_id: str, t: float) -> int:
        """Dispatches to ``instance_id`` after wall time ``t``."""
        return self.since_many([(instance_id, t)])[instance_id]

    def since_many(self, pairs: Iterable[tuple[str, float]]) -> dict[str, int]:
        """Dispatches to each instance after its wall time (one Redis round trip when shared)."""
        pairs = list(pairs)
        if self._use_redis() and pairs:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid, t in pairs:
                    pipe.zcount(f"{self.prefix}:{iid}", f"({t}", "+inf")
                return {iid: int(n) for (iid, _), n in zip(pairs, pipe.execute(), strict=True)}
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("count", exc)
        with self._lock:
            return {iid: self._local_since(iid, t) for iid, t in pairs}

    def _local_since(self, instance_id: str, t: float) -> int:
        # Caller holds the lock. Newest last: count back only until the first dispatch the
        # report already saw.
        times = self._times.get(instance_id, ())
        return sum(1 for _ in takewhile(lambda x: x > t, reversed(times)))

    def clear(self) -> None:
        with self._lock:
            ids = list(self._times)
            self._times.clear()
        if self._redis is not None and ids:
            try:
                self._redis.delete(*[f"{self.prefix}:{iid}" for iid in ids])
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


def with_dispatches(view: LiveView, ledger: DispatchLedger) -> ClusterSnapshot:
    """The view's snapshot with each instance's load raised by the requests this process routed
    to it after its last report (one running request per dispatch, over its capacity)."""
    snap = view.snapshot
    changed = False

    everything = (*snap.prefill, *snap.relay_decode, *snap.main_decode)
    counted = ledger.since_many(
        (st.id, view.reported[st.id][0])
        for st in everything
        if st.id in view.reported and view.reported[st.id][1] > 0
    )

    def adjusted(states: tuple[InstanceState, ...]) -> tuple[InstanceState, ...]:
        nonlocal changed
        out = []
        for st in states:
            _, capacity = view.reported.get(st.id, (0.0, 0.0))
            extra = counted.get(st.id, 0)
            if extra:
                changed = True
                st = replace(st, load=st.load + extra / capacity)
            out.append(st)
        return tuple(out)

    prefill = adjusted(snap.prefill)
    relay = adjusted(snap.relay_decode)
    main = adjusted(snap.main_decode)
    if not changed:
        return snap
    return ClusterSnapshot(
        prefill=prefill,
        relay_decode=relay,
        main_decode=main,
        wan_links=snap.wan_links,
        prefix_hits=snap.prefix_hits,
    )


DISPATCHED_BLOCKS_CAP = 65_536  # block hashes kept per MD (about 1.5 MB in Redis)
# Recorded prompts waiting for the writer thread to send them to Redis: past this many (Redis
# not keeping up), new ones are dropped and counted (DispatchedBlocks.dropped).
WRITES_PENDING_MAX = 1024
# How long a lookup waits for this process's own writes to the instances it asks about.
WRITE_WAIT_S = 1.0
CONFIRM_GRACE_S = 2.0  # a report received this long after a dispatch holds its blocks


# DispatchedBlocks.record on Redis, in one round trip. ARGV: now, the horizon's start, the cap,
# the key's TTL, the hashes' width and the hashes end to end. GT: a new hash is added, a known
# one only moves forward in time; each block a microsecond before the one above it, so that
# the cap (by rank) drops a prompt's deepest blocks first, as in memory. ZADD in slices that
# stay under Lua's limit on unpacked arguments.
_RECORD_LUA = """
local key = KEYS[1]
local now = tonumber(ARGV[1])
local width = tonumber(ARGV[5])
local packed = ARGV[6]
local n = #packed / width
local i = 0
while i < n do
  local stop = math.min(n, i + 2000)
  local args = {}
  for j = i, stop - 1 do
    args[#args + 1] = now - j * 1e-6
    args[#args + 1] = string.sub(packed, j * width + 1, (j + 1) * width)
  end
  redis.call('ZADD', key, 'GT', unpack(args))
  i = stop
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. ARGV[2])
redis.call('ZREMRANGEBYRANK', key, 0, -(tonumber(ARGV[3]) + 1))
redis.call('EXPIRE', key, ARGV[4])
return n
"""


class DispatchedBlocks(RedisFallback):
    """Prefix blocks of the prompts the gateway has sent to each MD, by wall time.

    MD's heartbeat reports the blocks its radix cache holds and those of the KV in flight to
    it (reserved at MD, not imported yet). A request the gateway has just dispatched is in
    neither until P's ``reserve`` reaches MD and MD's next heartbeat has gone out, so a
    session's next turn, sent right after the previous answer, would look like a miss and be
    relayed although MD will hold its prefix. The gateway therefore counts the blocks it
    dispatched to an MD since that MD's last report as held there
    (:func:`with_dispatched_blocks`), for every pipeline that ends on MD (p-md, p-rld-md).

    A report received more than ``grace_s`` after a dispatch confirms or drops it: by then
    MD's reservation (or its import) has put the blocks in the report, or the request failed.
    The grace covers the time from the gateway's dispatch to MD's reservation (the gateway
    calls P, P calls MD's ``reserve``, MD pins on its engine thread) and the time the report
    took to reach the control plane; counting a dispatch a little longer than needed only
    overlaps with what the report says. Entries older than ``horizon_s`` are dropped in any
    case, and at most ``cap`` hashes per MD are kept: the most recently dispatched, and of one
    prompt its leading blocks before its deeper ones.

    With ``redis_url`` every gateway process shares the ledger: one sorted set per MD, member
    a block hash, score its latest dispatch time. This process's own dispatches are kept in
    memory as well: if Redis fails, the ledger logs it and counts those, as
    :class:`DispatchLedger` does. A record goes to Redis from a writer thread, so the request
    that dispatched the prompt does not wait for it (Redis files a 64K prompt's 4,096 hashes
    in ~9 ms); a lookup of this process waits for its own writes to the MDs it asks about
    (usually sent already), another process sees them once sent.
    """

    _name = "dispatched-blocks ledger"

    def __init__(
        self,
        horizon_s: float = 30.0,
        redis_url: str = "",
        *,
        prefix: str = "baton:dispatched-blocks",
        cap: int = DISPATCHED_BLOCKS_CAP,
        grace_s: float = CONFIRM_GRACE_S,
    ) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.horizon_s = horizon_s
        self.prefix = prefix
        self.cap = cap
        self.grace_s = grace_s
        # instance id -> block hash -> latest dispatch time, least recently dispatched first
        self._blocks: dict[str, OrderedDict[str, float]] = {}
        self._lock = threading.Lock()
        # With Redis: instance id -> (dispatch time, hashes) of its prompts, oldest first, and
        # how many hashes that holds (``record``).
        self._log: dict[str, deque[tuple[float, tuple[str, ...]]]] = {}
        self._logged: dict[str, int] = {}
        self._script: Any = None
        # Writes to Redis, sent in order by a writer thread: seq -> (instance, hashes, time,
        # horizon start) until sent; at most WRITES_PENDING_MAX waiting (more are dropped and
        # counted in ``dropped``).
        self._pending: dict[int, tuple[str, tuple[str, ...], float, float]] = {}
        self._writes: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._seq = self._written = 0
        self._idle = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self.dropped = 0
        self._dropped_warned_at = -math.inf
        self._connect(redis_url)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def _record_script(self) -> Any:
        if self._script is None:
            self._script = self._redis.register_script(_RECORD_LUA)
        return self._script

    def record(
        self, instance_id: str | None, block_hashes: Sequence[str], now: float | None = None
    ) -> None:
        """The prompt with these prefix blocks was dispatched to MD ``instance_id`` at ``now``."""
        if not instance_id or not block_hashes:
            return
        now = time.time() if now is None else now
        oldest = now - self.horizon_s
        hashes = tuple(block_hashes)  # kept by reference: the log and the pending write
        with self._lock:
            if self._redis is None:
                self._remember(instance_id, hashes, now)
                return
            # Shared: Redis answers the lookups, and this process's copy is read only if Redis
            # fails. So it is kept as a log of prompts (a reference each, ~O(1)), turned into
            # the per-block map only then (``_replay``): keeping the map on every request cost
            # ~3 ms of CPU per 64K-token prompt.
            prompts = self._log.setdefault(instance_id, deque())
            prompts.append((now, hashes))
            held = self._logged.get(instance_id, 0) + len(hashes)
            while prompts and (held - len(prompts[0][1]) >= self.cap or prompts[0][0] < oldest):
                held -= len(prompts.popleft()[1])
            self._logged[instance_id] = held
            if not self._use_redis():
                return
            # Off the request path: Redis takes ~9 ms to file a 64K prompt's 4,096 hashes,
            # which the request would wait for. A lookup of this process on that MD waits for
            # the write until it is sent (``_written_for``).
            if len(self._pending) >= WRITES_PENDING_MAX:
                self.dropped += 1  # Redis is not keeping up: a hint lost, not a record
                if time.monotonic() - self._dropped_warned_at > 60:
                    self._dropped_warned_at = time.monotonic()
                    log.warning(
                        "%s: %d writes waiting for Redis; %d dispatches not shared so far",
                        self._name, len(self._pending), self.dropped,
                    )  # fmt: skip
                return
            self._seq += 1
            self._pending[self._seq] = (instance_id, hashes, now, oldest)
        self._writes.put(self._seq)
        self._ensure_writer()

    def _ensure_writer(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            return
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(
                    target=self._write_loop, name="dispatched-blocks-writer", daemon=True
                )
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            seq = self._writes.get()
            with self._lock:
                write = self._pending.get(seq)
            try:
                if write is not None:
                    self._write(*write)
            finally:
                with self._lock:
                    self._pending.pop(seq, None)
                    self._written = seq
                    self._idle.notify_all()

    def _write(
        self, instance_id: str, block_hashes: tuple[str, ...], now: float, oldest: float
    ) -> None:
        """One recorded prompt into Redis (the writer thread)."""
        if not self._use_redis():
            return  # Redis failed meanwhile: the log has it
        key = f"{self.prefix}:{instance_id}"
        ttl = int(self.horizon_s * 2) + 1
        try:
            width = len(block_hashes[0])
            if width and set(map(len, block_hashes)) == {width}:
                # One argument for the whole prompt (a 64K prompt's 4,096 hashes were 8,192
                # arguments for redis-py to pack); Redis gives the scores.
                self._record_script()(
                    keys=[key],
                    args=[repr(now), repr(oldest), self.cap, ttl, width, "".join(block_hashes)],
                )
            else:
                pipe = self._redis.pipeline(transaction=False)
                scores = {block: now - i * 1e-6 for i, block in enumerate(block_hashes)}
                pipe.zadd(key, scores, gt=True)
                pipe.zremrangebyscore(key, "-inf", f"({oldest}")
                pipe.zremrangebyrank(key, 0, -(self.cap + 1))
                pipe.expire(key, ttl)
                pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
            self._redis_failed("record", exc)

    def _written_for(self, instance_ids: set[str]) -> None:
        """Wait (at most WRITE_WAIT_S) until this process's writes to these instances are in
        Redis, so that its lookups read its own dispatches: the usual case waits for nothing
        (the last request's write went out while it ran)."""
        with self._lock:
            mine = [seq for seq, write in self._pending.items() if write[0] in instance_ids]
            if mine:
                self._wait_written(max(mine), WRITE_WAIT_S)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every write recorded so far has gone to Redis (or failed); False if
        ``timeout_s`` passed first."""
        with self._lock:
            return self._wait_written(self._seq, timeout_s)

    def _wait_written(self, seq: int, timeout_s: float) -> bool:
        """Under ``_lock``: wait until the writer is past write ``seq``."""
        return self._idle.wait_for(lambda: self._written >= seq, timeout_s)

    def _remember(self, instance_id: str, block_hashes: Sequence[str], now: float) -> None:
        """Put a dispatch in this process's per-block map (under ``_lock``)."""
        oldest = now - self.horizon_s
        blocks = self._blocks.setdefault(instance_id, OrderedDict())
        # Deepest first, so a prompt's leading blocks (the ones a hit is made of) are the
        # last to go when the cap is reached.
        # In bulk (C loops, 4,096 blocks of a 64K prompt): the known ones leave first, so
        # that the update puts every block at the end, in this order.
        fresh = dict.fromkeys(reversed(block_hashes), now)
        for block in blocks.keys() & fresh.keys():
            fresh[block] = max(now, blocks.pop(block))
        blocks.update(fresh)
        while blocks and (len(blocks) > self.cap or next(iter(blocks.values())) < oldest):
            blocks.popitem(last=False)

    def _replay(self) -> None:
        """Redis failed: this process's logged dispatches into its per-block map, in order
        (under ``_lock``)."""
        for iid, prompts in self._log.items():
            for at, hashes in prompts:
                self._remember(iid, hashes, at)
        self._log.clear()
        self._logged.clear()

    def held(
        self, instance_id: str, block_hashes: Sequence[str], after: float, now: float | None = None
    ) -> int:
        """How many of ``block_hashes``, from the first, were dispatched to ``instance_id``
        after wall time ``after`` (and within the horizon)."""
        return self.held_many([(instance_id, after, block_hashes)], now=now)[instance_id]

    def held_many(
        self, queries: Iterable[tuple[str, float, Sequence[str]]], now: float | None = None
    ) -> dict[str, int]:
        """:meth:`held` for each (instance, after, hashes). Shared: one Redis round trip for
        every query's first hash, a second only for the instances that have it, so a request
        costs little on the MDs that never saw its prefix."""
        queries = [(iid, after, hashes) for iid, after, hashes in queries]
        now = time.time() if now is None else now
        oldest = now - self.horizon_s
        runs = {iid: 0 for iid, _, _ in queries}
        asked = [(iid, max(after, oldest), hashes) for iid, after, hashes in queries if hashes]
        if self._use_redis() and asked:
            self._written_for({iid for iid, _, _ in asked})
            try:
                pipe = self._redis.pipeline(transaction=False)
                for iid, _, hashes in asked:
                    pipe.zscore(f"{self.prefix}:{iid}", hashes[0])
                starts = pipe.execute()
                rest = [q for q, t in zip(asked, starts, strict=True) if t is not None and t > q[1]]
                if rest:
                    pipe = self._redis.pipeline(transaction=False)
                    for iid, _, hashes in rest:
                        pipe.zmscore(f"{self.prefix}:{iid}", list(hashes))
                    for (iid, cutoff, _), scores in zip(rest, pipe.execute(), strict=True):
                        runs[iid] = _run(t is not None and t > cutoff for t in scores)
                return runs
            except Exception as exc:  # noqa: BLE001 - any Redis failure: count locally
                self._redis_failed("lookup", exc)
        with self._lock:
            self._replay()
            for iid, cutoff, hashes in asked:
                blocks = self._blocks.get(iid)
                if blocks:
                    runs[iid] = _run(blocks.get(h, -math.inf) > cutoff for h in hashes)
        return runs

    def clear(self) -> None:
        self.flush()  # a write still on its way would bring the cleared keys back
        with self._lock:
            ids = list(self._blocks.keys() | self._log.keys())
            self._blocks.clear()
            self._log.clear()
            self._logged.clear()
        if self._redis is not None and ids:
            try:
                self._redis.delete(*[f"{self.prefix}:{iid}" for iid in ids])
            except Exception as exc:  # noqa: BLE001
                self._redis_failed("clear", exc)


def _run(flags: Iterable[bool]) -> int:
    """How many of ``flags``, from the first, are true."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def with_dispatched_blocks(
    view: LiveView,
    snapshot: ClusterSnapshot,
    ledger: DispatchedBlocks,
    block_hashes: Sequence[str],
    now: float | None = None,
    hashes_for: Callable[[InstanceState], Sequence[str]] | None = None,
) -> tuple[ClusterSnapshot, dict[str, int]]:
    """``snapshot`` with each MD's cached prefix blocks extended by this request's blocks that
    the gateways dispatched to that MD since its last report (less the ledger's grace), and,
    per MD, how many of the request's leading blocks only the ledger supplied.

    Only the request's own leading run is added (what the policy matches); the view's snapshot
    is not changed. An MD that has never reported counts every dispatch within the horizon.
    ``hashes_for``: the request's hashes in an MD's own block size (RequestInfo.hashes_for),
    when MDs hash blocks of other sizes than ``block_hashes``'."""
    if not block_hashes or not snapshot.main_decode or snapshot.prefix_hits is not None:
        return snapshot, {}
    queries: list[tuple[str, float, Sequence[str]]] = []
    held_from: dict[str, int] = {}
    own: dict[str, Sequence[str]] = {}
    for st in snapshot.main_decode:
        if not st.healthy:
            continue
        hashes = own[st.id] = block_hashes if hashes_for is None else hashes_for(st)
        k = leading_run(hashes, st.cached_prefix_blocks)
        if k == len(hashes):
            continue
        reported_at = view.reported.get(st.id, (0.0, 0.0))[0]
        held_from[st.id] = k
        queries.append((st.id, reported_at - ledger.grace_s, hashes[k:]))
    if not queries:
        return snapshot, {}
    runs = ledger.held_many(queries, now=now)
    added: dict[str, int] = {}
    main = []
    for st in snapshot.main_decode:
        run = runs.get(st.id, 0)
        if run:
            k, hashes = held_from[st.id], own[st.id]
            cached, end = st.cached_prefix_blocks, k + run
            # Past the dispatched run, MD's report may hold more (a deeper cached block).
            end += leading_run(hashes[end:], cached)
            added[st.id] = end - k
            st = replace(st, cached_prefix_blocks=cached.union(hashes[k:end]))
        main.append(st)
    if not added:
        return snapshot, {}
    return (
        ClusterSnapshot(
            prefill=snapshot.prefill,
            relay_decode=snapshot.relay_decode,
            main_decode=tuple(main),
            wan_links=snapshot.wan_links,
            prefix_hits=snapshot.prefix_hits,
        ),
        added,
    )
