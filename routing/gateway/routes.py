"""Step 2 of a request's path: routing. The live view of the fleet (with this gateway's own
dispatches and the instances seen failing), the policy's decision and the plan for P; on a
failure, a retry before the first token or a migration after it (docs/faults.md), through
the ``recovery`` the composer hands the run. Routing writes no record: a refusal is raised as
``Refused``, a new attempt is noted by the run (``recorder``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from django.conf import settings

from pdd.policy import (
    Decision,
    NoHealthyPath,
    Pipeline,
    RequestInfo,
    decide,
    leading_run,
)
from pdd.prefix import prefix_block_hashes
from routing.caching import versions
from routing.dispatches import (
    DispatchedBlocks,
    DispatchLedger,
    with_dispatched_blocks,
    with_dispatches,
)
from routing.gateway.errors import unavailable
from routing.gateway.overload import overload
from routing.gateway.prepared import Prepared, Refused
from routing.gateway.runner import AgentBusy, AgentRunError, Sampling, build_plan
from routing.gateway.workers import in_worker
from routing.live import LiveView, LiveViewCache
from routing.policy_cache import PolicyCache
from routing.suspects import suspect_ledger, without_suspects

log = logging.getLogger(__name__)

live_views = LiveViewCache()
# Shared by every gateway process through Redis when REDIS_URL is set (else this process's).
dispatches = DispatchLedger(
    redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:dispatch"
)
# The prompts' prefix blocks sent to each MD, counted as held there until MD's next report.
dispatched_blocks = DispatchedBlocks(
    redis_url=settings.REDIS_URL, prefix=f"{settings.REDIS_KEY_PREFIX}:dispatched-blocks"
)
# Instances seen failing, avoided until their next report (shared through Redis when set).
suspects = suspect_ledger()
# Attempts on another path for a request that failed before its first token.
MAX_RETRIES = 2
# Moves of a request to another decoder after its decoder failed mid-stream.
MAX_MIGRATIONS = 2
policies = PolicyCache()
versions.on_refresh(policies.refresh)  # read off the request path while a refresher runs


def route_inputs(p: Prepared) -> LiveView:
    """What the first decision reads, with no side effect: the policy, the prompt's prefix
    blocks and the live view."""
    policy, version = policies.current()
    p.policy, p.version = policy, version
    p.first_token_early = policy.stream_first_token_early
    view = live_views.get(p.model.name)
    p.info = request_info(p, p.prompt_ids, p.greq.max_tokens, view)
    return view


def request_info(p: Prepared, ids: list[int], max_tokens: int, view: LiveView) -> RequestInfo:
    """What the policy knows of a request: its length and the prompt's prefix hashes in the
    served model's block size, and in each other block size an MD of the view hashes its
    cache in (an MD of another kind: agents/PROTOCOL.md, "KV formats")."""
    size = p.model.kv_block_size
    return RequestInfo(
        prompt_tokens=len(ids),
        max_tokens=max_tokens,
        prefix_block_hashes=prefix_block_hashes(ids, size),
        block_tokens=size,
        hashes_by_block={
            other: prefix_block_hashes(ids, other)
            for other in view.main_block_sizes()
            if other != size
        },
    )


def route_first(p: Prepared, view: LiveView | None = None) -> None:
    """The first decision for an admitted request: its inputs read first (``route_inputs``;
    ``view`` when given), then the decision, which counts the dispatch. No healthy path:
    Refused, a 503 (the composer records the refusal)."""
    if view is None:
        view = route_inputs(p)
    try:
        route(p, view)
    except NoHealthyPath as exc:
        late = ""
        if view.late:  # instances that may yet answer: their reports are late, not lost
            ages = sorted(view.late.values())
            late = (
                f" ({len(ages)} running instance(s) of the model report late, "
                f"{ages[0]:.1f}-{ages[-1]:.1f} s old)"
            )
        error = unavailable(f"No healthy path for model '{p.model.name}': {exc}{late}")
        raise Refused(p, error, f"no healthy path: {exc}{late}", late=bool(late)) from exc


def route(p: Prepared, view: LiveView | None = None) -> None:
    """Decide the path on the live view (``view``, else read now; with this gateway's
    dispatches, the KV already sent to each MD, and without the instances seen failing) and
    build the agents' plan; sets ``p.decision``, ``p.inputs``, ``p.url`` and ``p.plan``.
    Raises NoHealthyPath."""
    if view is None:
        view = live_views.get(p.model.name)
    info, policy = p.info, p.policy
    if info is None or policy is None:
        raise RuntimeError("route() needs route_inputs() first (the request info, the policy)")
    snapshot = with_dispatches(view, dispatches)
    reported = snapshot  # what the MDs' own reports say they hold (before the ledger's part)
    # MD will hold what the gateways have already sent it (KV on its way, not yet in its
    # heartbeat): a session's next turn sent right after the previous answer is a hit there.
    snapshot, in_flight = with_dispatched_blocks(
        view,
        snapshot,
        dispatched_blocks,
        info.prefix_block_hashes,
        hashes_for=(lambda st: info.hashes_for(st)[0]) if info.hashes_by_block else None,
    )
    snapshot, avoided = without_suspects(view, snapshot, suspects)
    inputs = {
        "prompt_tokens": len(p.prompt_ids),
        "max_tokens": p.greq.max_tokens,
        "instances": {
            i.id: {
                "role": i.role,
                "healthy": i.healthy,
                "load": round(i.load, 3),
                "dc": i.datacenter,
            }
            for i in (
                *snapshot.prefill,
                *snapshot.relay_decode,
                *snapshot.main_decode,
            )
        },
        "wan_links": {
            dc: {
                "gbps": link.bandwidth_gbps,
                "rtt_ms": link.rtt_ms,
                "use": round(link.utilisation, 3),
                "status": link.status,
            }
            for dc, link in snapshot.wan_links.items()
        },
    }
    if in_flight:
        # Per MD, the prompt's leading blocks counted as held only because a gateway had
        # already dispatched them there (its heartbeat did not show them yet).
        inputs["dispatched_blocks"] = in_flight
    if avoided:
        inputs["suspect"] = avoided  # seen failing since their last report: routed around
    if p.retried:
        inputs["retried"] = p.retried
    p.inputs = inputs
    decision = decide(info, snapshot, policy)
    dispatches.record((decision.prefill_id, decision.relay_id, decision.main_id))
    if decision.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
        # Only the blocks past what MD's report already holds: a later request asks the
        # ledger from the end of MD's reported run (with_dispatched_blocks), so the leading
        # ones would never be read. At a 90% hit that is a tenth of a 64K prompt's 4,000
        # hashes sent to Redis per request.
        main = next((st for st in reported.main_decode if st.id == decision.main_id), None)
        hashes = info.prefix_block_hashes if main is None else info.hashes_for(main)[0]
        start = leading_run(hashes, main.cached_prefix_blocks) if main is not None else 0
        dispatched_blocks.record(decision.main_id, hashes[start:])
    # The agents see each attempt as its own request (a retry must not meet the first one's
    # leftovers); the record keeps the gateway's id.
    agent_request_id = p.request_id if not p.attempt else f"{p.request_id}-r{p.attempt}"
    # A migrated request continues from the prompt plus what the user already has.
    ids = p.continue_ids or p.prompt_ids
    max_tokens = p.continue_max_tokens or p.greq.max_tokens
    p.prefill_http = view.endpoints[decision.prefill_id].http
    p.url, p.plan = build_plan(
        request_id=agent_request_id,
        prompt_ids=ids,
        sampling=Sampling(
            max_tokens, p.greq.temperature, p.greq.top_p, p.greq.seed, p.greq.logprobs
        ),
        decision=decision,
        view=view,
        early_first_token=policy.stream_first_token_early,
    )
    p.decision = decision


def implicated(decision: Decision, exc: AgentRunError) -> list[str]:
    """The instances a failure points at, from its typed role (AgentRunError.role), never its
    text: P itself when P could not be reached; the role that failed when the error names one
    (MD when RLD or P report MD's failure, or MD's own stream read directly; RLD likewise);
    else P's next hop, the relay where the pipeline has one. Marking both decoders would
    leave a one-RLD, one-MD fleet no path to migrate to, although only one of them died."""
    if exc.at_prefill:
        return [decision.prefill_id]
    if exc.role == "md" and decision.main_id:
        return [decision.main_id]
    if exc.role == "rld" and decision.relay_id:
        return [decision.relay_id]
    hop = decision.relay_id or decision.main_id
    return [hop] if hop else []


def reroute(
    p: Prepared, exc: AgentRunError, record: dict[str, Any], *, blame: bool = True
) -> tuple[list[str], str]:
    """Mark the instances `exc` implicates suspect (unless ``blame`` is False: an engine that
    was full is not failing), note the attempt (`record` added to its entry in the decision
    inputs) and route `p` again. Returns the implicated ids and, when no path is left, why
    (else ""). The run notes the new attempt on the admission (``recorder.attempt``)."""
    d = p.decision
    if d is None:
        raise RuntimeError("reroute() of a request that was never routed")
    blamed = implicated(d, exc)
    if blame:
        suspects.mark(blamed)
    p.retried.append(
        {"pipeline": d.pipeline, "instances": blamed, "error": str(exc)[:300], **record}
    )
    p.attempt += 1
    try:
        route(p)
    except NoHealthyPath as no_path:
        return blamed, str(no_path) or "no healthy path"
    return blamed, ""


def migrate(p: Prepared, exc: AgentRunError, delivered: list[int], remaining: int) -> bool:
    """The decoder failed after `delivered` tokens went out: route the prompt plus those
    tokens again for the `remaining` ones (its prefix is cached where the KV is held, so MD's
    cache makes that cheap). False past the limit or with no path left."""
    if p.migrations >= MAX_MIGRATIONS or p.attempt >= MAX_RETRIES + MAX_MIGRATIONS:
        return False
    ids = [*p.prompt_ids, *delivered]
    p.continue_ids, p.continue_max_tokens = ids, remaining
    p.info = request_info(p, ids, remaining, live_views.get(p.model.name))
    implicated, no_path = reroute(p, exc, {"migrated_at_token": len(delivered)})
    if no_path:
        log.warning(
            "request %s: %s failed after %d tokens (%s); no path to migrate to: %s",
            p.request_id, implicated, len(delivered), exc, no_path,
        )  # fmt: skip
        return False
    p.migrations += 1
    log.warning(
        "request %s: %s failed after %d tokens (%s); migrated to %s",
        p.request_id, implicated, len(delivered), exc, _pipeline(p),
    )  # fmt: skip
    return True


def _pipeline(p: Prepared) -> str:
    return p.decision.pipeline if p.decision is not None else ""


def retry_when_room(p: Prepared, exc: AgentRunError) -> bool:
    """After an engine had no room for the request (before its first token): route it again,
    blaming no instance (the caller waited in the overload queue first). False when no path
    is left."""
    _, no_path = reroute(p, exc, {"busy": True}, blame=False)
    return not no_path


def retry_elsewhere(p: Prepared, exc: AgentRunError) -> bool:
    """After a failure before the user got any token: route the request again. False when
    the retries are used up or no path is left."""
    if p.attempt >= MAX_RETRIES:
        return False
    implicated, no_path = reroute(p, exc, {})
    if no_path:
        return False
    log.warning(
        "request %s: %s failed before its first token (%s); retrying on %s",
        p.request_id, implicated, exc, _pipeline(p),
    )  # fmt: skip
    return True


def recovery(p: Prepared):
    """What the run calls when an attempt of ``p`` fails (``run.Recover``): route it again, a
    retry before the first token, a migration after it; an engine with no room first waits in
    the overload queue. The routing runs on a worker thread. True when a new attempt is ready."""

    async def recover(exc: AgentRunError, delivered: list[int], remaining: int) -> bool:
        if isinstance(exc, AgentBusy) and not delivered:
            # Capacity, not a fault: wait in the overload queue, then route again.
            if p.busy_since is None:
                p.busy_since = time.monotonic()
            await overload.wait(p.key.tenant.name, p.busy_since, p.busy_tries)
            p.busy_tries += 1
            return await in_worker(retry_when_room)(p, exc)
        if not delivered:
            return await in_worker(retry_elsewhere)(p, exc)
        return await in_worker(migrate)(p, exc, delivered, remaining)

    return recover
