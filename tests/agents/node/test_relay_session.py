"""RLD's relay state machine (agents/node/relay.py) without processes: RelaySession driven
with fake items on a fake agent, engine worker and WAN client. Legal and illegal phase
changes, and each kind of item in each phase (the table in agents/PROTOCOL.md)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from types import SimpleNamespace

import pytest

from agents.engine import EngineFull, SamplingParams, TokenOutput
from agents.node.relay import RelaySession, run_relay
from agents.node.relay_phases import (
    TRANSITIONS,
    Cancelled,
    KvArrived,
    MdClosed,
    MdEvent,
    MdFailed,
    Phase,
    RelayRequest,
    RldFailed,
    RldOutput,
    Unexpected,
    as_item,
)
from agents.node.wire import HandoffPlan

PROMPT = [5, 6, 7, 8]
RID = "r1"


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_import: Exception | None = None

    def import_prefix(self, rid, prompt, start, payload):
        if self.fail_import is not None:
            raise self.fail_import
        self.calls.append(("import_prefix", rid))

    def start_decode(self, rid, prompt, first, sampling):
        self.calls.append(("start_decode", rid))

    def release(self, rid):
        self.calls.append(("release", rid))

    def abort(self, rid):
        self.calls.append(("abort", rid))
        return True


class FakeWorker:
    def __init__(self) -> None:
        self.engine = FakeEngine()
        self.sinks: dict = {}

    def add_sink(self, rid, sink) -> None:
        self.sinks[rid] = sink

    def remove_sink(self, rid) -> None:
        self.sinks.pop(rid, None)

    def call(self, fn) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn(self.engine))
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future


class FakeClient:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, tuple[int, ...]]] = []
        self.fail: Exception | None = None

    async def send(self, host, port, tid, chunks, tokens=None):
        if self.fail is not None:
            raise self.fail
        self.sent.append((tid, tokens.token_start, tokens.ids))
        return SimpleNamespace(bytes_sent=10 * len(tokens.ids))


class FakeHttp:
    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []

    async def post(self, url, json, timeout):
        self.posts.append((url, json))


class FakeInbox:
    def __init__(self) -> None:
        self.queues: dict = {}
        self.dropped: list = []

    def queue(self, rid, iid) -> asyncio.Queue:
        return self.queues.setdefault((rid, iid), asyncio.Queue())

    def drop(self, rid, iid) -> None:
        self.dropped.append((rid, iid))


class FakeInstances:
    def __init__(self) -> None:
        self.counted = 0

    def count_tokens(self, inst) -> None:
        self.counted += 1


class FakeLinks:
    def __init__(self, ack_s: float) -> None:
        self.client = FakeClient()
        self.ack_s = ack_s

    def handoff_ack_timeout_s(self, dc) -> float:
        return self.ack_s

    def wan_client(self, dc) -> FakeClient:
        return self.client


class FakeAgent:
    def __init__(self, ack_s: float = 30.0, kv_timeout_s: float = 5.0) -> None:
        self.settings = SimpleNamespace(kv_timeout_s=kv_timeout_s)
        self.background: set = set()
        self.http = FakeHttp()
        self.inbox = FakeInbox()
        self.instances = FakeInstances()
        self.links = FakeLinks(ack_s)
        self.client = self.links.client

    def keep(self, task) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)


MAIN = SimpleNamespace(
    http="http://md", instance="9", datacenter="dc-b", kv_address=lambda wan: ("md", 1)
)


def make(
    main=MAIN, plan: HandoffPlan | None = None, **agent_kw
) -> tuple[RelaySession, FakeAgent, FakeWorker]:
    agent, worker = FakeAgent(**agent_kw), FakeWorker()
    inst = SimpleNamespace(instance_id="0", worker=worker, running_worker=worker)
    req = RelayRequest(RID, PROMPT, 4, SamplingParams(), main, 0, plan or HandoffPlan())
    return RelaySession(agent, inst, req), agent, worker


def run(scenario) -> None:
    asyncio.run(scenario())


def out(*ids: int, finished: bool = False, reason: str | None = None) -> RldOutput:
    return RldOutput(TokenOutput(RID, list(ids), finished, reason))


def md_token(index: int, token_id: int = 100) -> MdEvent:
    return MdEvent({"type": "token", "index": index, "token_id": token_id, "role": "md"})


KV = KvArrived(SimpleNamespace(chunks=()))
READY = MdEvent({"type": "ready", "slot_wait_s": 0.25})


def drain(s: RelaySession) -> list[dict]:
    events = list(s.outbox)
    s.outbox.clear()
    return events


def tokens(events: list[dict]) -> list[tuple[int, str]]:
    return [(e["index"], e["role"]) for e in events if e["type"] == "token"]


async def replay(s: RelaySession) -> None:
    """Dispatch what the session put back on its own queue (early items, deadline)."""
    while not s.queue.empty():
        await s.dispatch(as_item(s.queue.get_nowait()))


async def relaying(s: RelaySession) -> None:
    await s.dispatch(KV)
    assert s.phase is Phase.RELAY


async def final(s: RelaySession, agent: FakeAgent) -> None:
    """RELAY with two RLD tokens, then MD ready: the final batch goes out, cut at index 3."""
    await relaying(s)
    await s.dispatch(out(11))
    await s.dispatch(out(12))
    await s.dispatch(READY)
    assert s.phase is Phase.FINAL
    assert s.handoff.at_token == 3
    await asyncio.sleep(0)  # the send task runs
    assert agent.client.sent == [(f"{RID}|9|h0.final", len(PROMPT) + 1, (11, 12))]
    drain(s)


async def main_phase(s: RelaySession, agent: FakeAgent, worker: FakeWorker) -> None:
    await final(s, agent)
    await s.dispatch(out(13))  # buffered
    await s.dispatch(md_token(3, 13))
    assert s.phase is Phase.MAIN
    assert ("release", RID) in worker.engine.calls
    assert s.buffered == [] and not s.engine_live and RID not in worker.sinks
    assert tokens(drain(s)) == [(3, "md")]


async def solo(s: RelaySession, agent: FakeAgent) -> None:
    await relaying(s)
    await s.dispatch(MdClosed(ConnectionError("gone")))
    assert s.phase is Phase.SOLO
    drain(s)


# -- transitions -------------------------------------------------------------------------------


LEGAL = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


def test_the_transition_table_is_the_documented_graph() -> None:
    assert {
        (Phase.WAIT_KV, Phase.RELAY),
        (Phase.WAIT_KV, Phase.DONE),
        (Phase.RELAY, Phase.FINAL),
        (Phase.RELAY, Phase.SOLO),
        (Phase.RELAY, Phase.DONE),
        (Phase.FINAL, Phase.MAIN),
        (Phase.FINAL, Phase.SOLO),
        (Phase.FINAL, Phase.DONE),
        (Phase.MAIN, Phase.DONE),
        (Phase.SOLO, Phase.DONE),
    } == LEGAL


@pytest.mark.parametrize("start,target", sorted(itertools.product(Phase, Phase)))
def test_each_transition_is_legal_or_ends_the_request_with_an_error(
    start: Phase, target: Phase, caplog
) -> None:
    async def scenario():
        s, _, _ = make()
        s.phase = start
        with caplog.at_level(logging.ERROR, logger="agents.node.relay"):
            ok = s.to(target)
        if (start, target) in LEGAL:
            assert ok and s.phase is target and not s.outbox
            assert not caplog.records
            return
        assert not ok
        assert s.phase is Phase.DONE  # never a silent overwrite with the illegal target
        assert "illegal transition" in caplog.records[0].getMessage()
        if start is Phase.DONE:
            assert not s.outbox  # the stream is over: nothing more goes out
        else:
            [event] = drain(s)
            assert event["type"] == "error" and f"{start} -> {target}" in event["message"]

    run(scenario)


def test_nothing_is_dispatched_after_the_end() -> None:
    async def scenario():
        s, _, _ = make()
        s.phase = Phase.DONE
        for item in (KV, out(1), READY, md_token(1), MdFailed("x"), Cancelled(RuntimeError())):
            await s.dispatch(item)
        assert s.phase is Phase.DONE and not s.outbox

    run(scenario)


def test_inbox_items_become_typed_items() -> None:
    transfer = object()
    assert as_item(("kv", transfer)) == KvArrived(transfer)
    cancel = RuntimeError("cancelled")
    assert as_item(cancel) == Cancelled(cancel)
    assert as_item(("h0", transfer)) == Unexpected("h0", transfer)
    assert as_item(READY) is READY
    assert as_item(42) == Unexpected(42)


# -- WAIT_KV -----------------------------------------------------------------------------------


def test_wait_kv_the_kv_starts_the_relay_and_replays_what_came_before() -> None:
    async def scenario():
        s, agent, worker = make()
        await s.dispatch(READY)  # MD's stream reported first: kept
        await s.dispatch(MdEvent({"type": "extended", "upto": 1}))
        assert s.phase is Phase.WAIT_KV and len(s.early) == 2 and not s.handoff.md_ready
        await s.dispatch(KV)
        assert s.phase is Phase.RELAY and s.engine_live
        assert worker.engine.calls == [("import_prefix", RID), ("start_decode", RID)]
        assert s.early == [] and [as_item(i) for i in list(s.queue._queue)] == [
            READY,
            MdEvent({"type": "extended", "upto": 1}),
        ]
        worker.sinks[RID](TokenOutput(RID, [11], False, None))  # the sink queues typed items
        worker.sinks[RID](RuntimeError("boom"))
        await replay(s)
        # ready replayed before RLD's first token: with handoff_at 0 the cut is at index 1
        # (an empty final batch), RLD's token is buffered, and its engine failure ends it.
        assert s.handoff.md_ready and s.handoff.at_token == 1
        await asyncio.sleep(0)
        assert agent.client.sent == [(f"{RID}|9|h0.final", len(PROMPT) + 1, ())]
        assert s.phase is Phase.DONE
        assert drain(s) == [{"type": "error", "message": f"{RID}: engine failed: boom"}]

    run(scenario)


def test_wait_kv_a_cancel_or_failed_transfer_ends_the_request() -> None:
    async def scenario():
        s, _, _ = make()
        await s.dispatch(Cancelled(RuntimeError("cancelled")))
        assert s.phase is Phase.DONE
        assert drain(s) == [{"type": "error", "message": f"{RID}: KV transfer failed: cancelled"}]

    run(scenario)


def test_wait_kv_no_kv_in_time_ends_the_request() -> None:
    async def scenario():
        s, agent, _ = make(kv_timeout_s=0.05)
        events = [e async for e in s.events()]
        assert events == [{"type": "error", "message": f"{RID}: no KV from P within 0.05 s"}]
        await asyncio.sleep(0)
        assert agent.http.posts == [("http://md/v1/pdd/cancel", {"request_id": RID})]

    run(scenario)


def test_wait_kv_an_import_that_fails_ends_the_request() -> None:
    async def scenario():
        s, _, worker = make()
        worker.engine.fail_import = EngineFull("no blocks")
        await s.dispatch(KV)
        assert s.phase is Phase.DONE and not s.engine_live
        [event] = drain(s)
        assert event["message"] == f"{RID}: cannot import KV: EngineFull: no blocks"

    run(scenario)


# -- RELAY -------------------------------------------------------------------------------------


def test_relay_streams_rld_tokens_and_finishes_alone() -> None:
    async def scenario():
        s, agent, worker = make(plan=HandoffPlan(handoff_at=10))
        await relaying(s)
        await s.dispatch(out(11))
        await s.dispatch(READY)  # ready but handoff_at not reached: no handoff
        await s.dispatch(out(12, finished=True, reason="length"))
        events = drain(s)
        assert tokens(events) == [(1, "rld"), (2, "rld")]
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["stats"]["tokens_by_role"] == {"rld": 2, "md": 0}
        assert done["stats"]["handoff"]["completed"] is False
        assert s.phase is Phase.DONE and s.finished_here and not s.engine_live
        await s.close()
        await asyncio.sleep(0)
        # MD keeps P's KV: not cancelled but released, in case RLD's decode call never
        # reached it (MD then caches the KV from its reservation's prompt).
        assert agent.http.posts == [
            ("http://md/v1/pdd/release", {"request_id": RID, "instance": "9", "start_token": 0})
        ]
        assert ("abort", RID) not in worker.engine.calls
        assert agent.instances.counted == 2

    run(scenario)


def test_relay_without_md_never_hands_off() -> None:
    async def scenario():
        s, agent, _ = make(main=None)
        await relaying(s)
        await s.dispatch(READY)
        await s.dispatch(out(11))
        assert s.phase is Phase.RELAY and agent.client.sent == []
        assert s.handoff.mode == "none"

    run(scenario)


@pytest.mark.parametrize(
    "item,reason",
    [
        (md_token(1), "MD sent token 1 before the handoff"),
        (MdEvent({"type": "done", "finish_reason": "stop"}), "MD finished before the handoff"),
        (MdEvent({"type": "error", "message": "oom"}), "MD reported: oom"),
        (MdClosed(None), "MD stream closed: None"),
        (MdFailed("handoff send failed: X"), "handoff send failed: X"),
    ],
)
def test_relay_an_md_or_wan_failure_leaves_rld_to_finish(item, reason) -> None:
    async def scenario():
        s, agent, _ = make()
        await relaying(s)
        await s.dispatch(out(11))
        await s.dispatch(item)
        assert s.phase is Phase.SOLO and s.handoff.failed == reason
        await asyncio.sleep(0)
        assert agent.http.posts == [("http://md/v1/pdd/cancel", {"request_id": RID})]
        await s.dispatch(READY)  # whatever MD still says is ignored
        await s.dispatch(out(12, finished=True, reason="stop"))
        events = drain(s)
        assert tokens(events) == [(1, "rld"), (2, "rld")]
        assert events[-1]["stats"]["handoff"]["failed"] == reason
        assert s.phase is Phase.DONE and not s.finished_here

    run(scenario)


@pytest.mark.parametrize(
    "item,message",
    [
        (Cancelled(RuntimeError("cancelled")), f"{RID}: cancelled"),
        (RldFailed(RuntimeError("step")), f"{RID}: engine failed: step"),
    ],
)
def test_relay_a_cancel_or_engine_failure_ends_the_request(item, message) -> None:
    async def scenario():
        s, agent, worker = make()
        await relaying(s)
        await s.dispatch(item)
        assert s.phase is Phase.DONE
        assert drain(s) == [{"type": "error", "message": message}]
        await s.close()
        await asyncio.sleep(0)
        assert ("abort", RID) in worker.engine.calls  # RLD's engine still held it
        assert agent.http.posts == [("http://md/v1/pdd/cancel", {"request_id": RID})]

    run(scenario)


def test_relay_ignores_a_second_kv_and_unknown_items() -> None:
    async def scenario():
        s, _, worker = make()
        await relaying(s)
        await s.dispatch(KV)
        await s.dispatch(Unexpected("h0", None))
        assert s.phase is Phase.RELAY and not s.outbox
        assert worker.engine.calls.count(("import_prefix", RID)) == 1

    run(scenario)


def test_catch_up_batches_then_the_final_one() -> None:
    async def scenario():
        plan = HandoffPlan(mode="catch-up", catch_up_batch=2, max_catch_up_batches=1)
        s, agent, _ = make(plan=plan)
        await relaying(s)
        await s.dispatch(out(11))
        await s.dispatch(out(12))
        await s.dispatch(READY)  # 2 pending >= batch: a catch-up batch, still RELAY
        assert s.phase is Phase.RELAY and s.handoff.inflight
        await s.dispatch(out(13))  # streamed meanwhile
        await s.dispatch(MdEvent({"type": "extended", "upto": 3}))
        assert s.phase is Phase.FINAL and s.handoff.at_token == 4
        await asyncio.sleep(0)
        assert agent.client.sent == [
            (f"{RID}|9|h0", 5, (11, 12)),
            (f"{RID}|9|h1.final", 7, (13,)),
        ]
        assert tokens(drain(s)) == [(1, "rld"), (2, "rld"), (3, "rld")]
        assert s.handoff.bytes == 30

    run(scenario)


def test_catch_up_rounds_go_on_while_each_leaves_a_smaller_gap() -> None:
    async def scenario():
        plan = HandoffPlan(mode="catch-up", catch_up_batch=2, max_catch_up_batches=8)
        s, agent, _ = make(plan=plan)
        await relaying(s)
        await s.dispatch(out(11, 12, 13, 14))
        await s.dispatch(READY)  # 4 pending: batch h0
        await s.dispatch(out(15, 16))  # decoded while MD extends h0
        await s.dispatch(MdEvent({"type": "extended", "upto": 5}))  # 2 < 4: batch h1
        assert s.phase is Phase.RELAY
        await s.dispatch(out(17))
        await s.dispatch(MdEvent({"type": "extended", "upto": 7}))  # 1 < batch: the final
        assert s.phase is Phase.FINAL
        assert s.handoff.batch_tokens == [4, 2, 1]

    run(scenario)


def test_catch_up_that_does_not_shrink_the_gap_falls_back_to_the_final_batch() -> None:
    """RLD decodes faster than MD extends plus the round trip: the gap grows each round, so
    however many rounds are allowed, the next one is the final (one-shot) batch."""

    async def scenario():
        plan = HandoffPlan(mode="catch-up", catch_up_batch=2, max_catch_up_batches=1000)
        s, agent, _ = make(plan=plan)
        await relaying(s)
        await s.dispatch(out(11, 12))
        await s.dispatch(READY)  # batch h0 of 2
        await s.dispatch(out(13, 14, 15))  # 3 decoded meanwhile: the gap grew
        await s.dispatch(MdEvent({"type": "extended", "upto": 3}))
        assert s.phase is Phase.FINAL
        await asyncio.sleep(0)
        assert [sent[0] for sent in agent.client.sent] == [f"{RID}|9|h0", f"{RID}|9|h1.final"]
        assert s.handoff.batch_tokens == [2, 3]
        assert s.handoff.to_json()["batch_tokens"] == [2, 3]

    run(scenario)


def test_a_batch_whose_send_fails_abandons_the_handoff() -> None:
    async def scenario():
        s, agent, _ = make()
        agent.client.fail = ConnectionError("wan down")
        await relaying(s)
        await s.dispatch(out(11))
        await s.dispatch(READY)
        assert s.phase is Phase.FINAL
        await asyncio.sleep(0)
        await replay(s)  # the send task queued MdFailed
        assert s.phase is Phase.SOLO
        assert s.handoff.failed.startswith("handoff send failed: ConnectionError")

    run(scenario)


# -- FINAL -------------------------------------------------------------------------------------


def test_final_buffers_rld_and_mds_token_c_completes_the_handoff() -> None:
    async def scenario():
        s, agent, worker = make()
        await main_phase(s, agent, worker)
        await s.dispatch(md_token(4, 14))
        await s.dispatch(MdEvent({"type": "done", "finish_reason": "stop"}))
        events = drain(s)
        assert tokens(events) == [(4, "md")]
        stats = events[-1]["stats"]
        assert stats["tokens_by_role"] == {"rld": 2, "md": 2}
        assert stats["handoff"] == {
            "mode": "one-shot",
            "at_token": 3,
            "batches": 1,
            "completed": True,
            "failed": None,
            "tokens_handed": 2,
            "batch_tokens": [2],
            "slot_wait_s": 0.25,
        }
        assert stats["handoff_bytes"] == 20
        assert s.phase is Phase.DONE and s.md_done
        await s.close()
        await asyncio.sleep(0)
        assert agent.http.posts == [] and ("abort", RID) not in worker.engine.calls

    run(scenario)


@pytest.mark.parametrize(
    "item",
    [
        md_token(5),  # a token but not c
        MdEvent({"type": "error", "message": "oom"}),
        MdClosed(ConnectionError("killed")),
        MdFailed("no acknowledgement within 1.50 s"),
    ],
)
def test_final_a_failure_flushes_the_buffer_with_no_gap(item) -> None:
    async def scenario():
        s, agent, _ = make()
        await final(s, agent)
        await s.dispatch(out(13))
        await s.dispatch(out(14))
        assert not s.outbox and len(s.buffered) == 2
        await s.dispatch(item)
        assert s.phase is Phase.SOLO and s.buffered == []
        assert tokens(drain(s)) == [(3, "rld"), (4, "rld")]
        await s.dispatch(out(15))
        assert tokens(drain(s)) == [(5, "rld")]

    run(scenario)


def test_final_a_buffered_finish_ends_the_request_when_flushed() -> None:
    async def scenario():
        s, agent, _ = make()
        await final(s, agent)
        await s.dispatch(out(13, finished=True, reason="stop"))
        await s.dispatch(MdClosed(None))
        events = drain(s)
        assert tokens(events) == [(3, "rld")]
        assert events[-1]["type"] == "done" and s.phase is Phase.DONE
        assert not s.finished_here  # MD was abandoned: it is cancelled

    run(scenario)


def test_final_no_acknowledgement_within_the_window_abandons_the_handoff() -> None:
    async def scenario():
        s, agent, _ = make(ack_s=0.02)
        await final(s, agent)
        await asyncio.sleep(0.05)
        await replay(s)
        assert s.phase is Phase.SOLO
        assert s.handoff.failed == "no acknowledgement within 0.02 s"

    run(scenario)


def test_final_the_acknowledgement_cancels_the_window() -> None:
    async def scenario():
        s, agent, worker = make(ack_s=0.02)
        await main_phase(s, agent, worker)
        await asyncio.sleep(0.05)
        assert s.queue.empty()  # the timer was cancelled
        assert s.phase is Phase.MAIN

    run(scenario)


def test_final_a_cancel_ends_the_request() -> None:
    async def scenario():
        s, agent, _ = make()
        await final(s, agent)
        await s.dispatch(Cancelled(RuntimeError("cancelled")))
        assert s.phase is Phase.DONE
        assert drain(s) == [{"type": "error", "message": f"{RID}: cancelled"}]

    run(scenario)


# -- MAIN --------------------------------------------------------------------------------------


def test_main_ignores_rld_and_late_rld_side_failures() -> None:
    async def scenario():
        s, agent, worker = make()
        await main_phase(s, agent, worker)
        for item in (out(99), RldFailed(RuntimeError("x")), MdFailed("late"), READY, KV):
            await s.dispatch(item)
        assert s.phase is Phase.MAIN and not s.outbox and s.handoff.failed is None

    run(scenario)


@pytest.mark.parametrize(
    "item,message,role",
    [
        (md_token(7), f"{RID}: MD sent index 7, expected 4", "md"),
        (
            MdEvent({"type": "error", "message": "oom"}),
            f"{RID}: MD failed after the handoff: {{'type': 'error', 'message': 'oom'}}",
            "md",
        ),
        (MdClosed(None), f"{RID}: MD stream ended after the handoff: None", "md"),
        (Cancelled(RuntimeError("cancelled")), f"{RID}: cancelled", None),
    ],
)
def test_main_a_failure_of_md_fails_the_request(item, message, role) -> None:
    """MD's failures name MD as the role that failed (the gateway blames MD, not RLD)."""

    async def scenario():
        s, agent, worker = make()
        await main_phase(s, agent, worker)
        await s.dispatch(item)
        assert s.phase is Phase.DONE
        expected = {"type": "error", "message": message, **({"role": role} if role else {})}
        assert drain(s) == [expected]
        await s.close()
        await asyncio.sleep(0)
        assert agent.http.posts == [("http://md/v1/pdd/cancel", {"request_id": RID})]
        assert ("abort", RID) not in worker.engine.calls  # released at the handoff

    run(scenario)


# -- SOLO --------------------------------------------------------------------------------------


def test_solo_streams_rld_and_ignores_md() -> None:
    async def scenario():
        s, agent, _ = make()
        await solo(s, agent)
        for item in (md_token(1), MdFailed("x"), MdClosed(None), READY):
            await s.dispatch(item)
        assert s.phase is Phase.SOLO and not s.outbox
        await s.dispatch(out(11))
        assert tokens(drain(s)) == [(1, "rld")]
        await s.dispatch(RldFailed(RuntimeError("step")))
        assert drain(s) == [{"type": "error", "message": f"{RID}: engine failed: step"}]

    run(scenario)


# -- the whole stream --------------------------------------------------------------------------


def test_run_relay_streams_and_cleans_up_when_the_caller_leaves() -> None:
    async def scenario():
        agent, worker = FakeAgent(), FakeWorker()
        inst = SimpleNamespace(instance_id="0", worker=worker, running_worker=worker)
        req = RelayRequest(RID, PROMPT, 4, SamplingParams(), None, 0, HandoffPlan())
        stream = run_relay(agent, inst, req)
        queue = agent.inbox.queue(RID, "0")
        queue.put_nowait(("kv", SimpleNamespace(chunks=())))
        queue.put_nowait(out(11))
        first = await stream.__anext__()
        assert first == {"type": "token", "index": 1, "token_id": 11, "role": "rld"}
        await stream.aclose()  # the caller left: RLD's engine lets the request go at once
        assert ("abort", RID) in worker.engine.calls
        assert agent.inbox.dropped == [(RID, "0")]

    run(scenario)
