"""Synthetic request records for tests and demos of the dashboard (never a source of figures).

They follow the shape docs/pdd.md describes - agentic prompts with long context, a skewed prefix-hit
distribution (most requests > 95% hit go P-MD, low-hit ones P-RLD-MD with a handoff), short
outputs - and use the fleet's real instance ids so WAN bytes resolve to links.
"""

from __future__ import annotations

import random
import uuid

from django.db import transaction

from billing.models import Tenant
from fleet.choices import InstanceRole
from fleet.models import Instance
from routing.choices import HandoffChoice, PipelineChoice, RequestStatus
from routing.models import RequestRecord, RoutingDecision

SYNTHETIC_TENANT = "synthetic"


def _pick(rng: random.Random, ids: list[str]) -> str:
    return rng.choice(ids) if ids else ""


@transaction.atomic
def synthetic_records_create(
    *, count: int, seed: int | None = None, model: str | None = None, kv_bytes_per_token: int = 0
) -> list[RequestRecord]:
    """Write ``count`` realistic finished-request records (with their routing decisions)."""
    rng = random.Random(seed)
    tenant, _ = Tenant.objects.get_or_create(
        name=SYNTHETIC_TENANT, defaults={"display_name": "Synthetic traffic (tests / demo)"}
    )
    ids: dict[str, list[str]] = {role: [] for role in InstanceRole.values}
    served = model
    for inst in Instance.objects.select_related("served_model"):
        ids[inst.role].append(str(inst.pk))
        served = served or inst.served_model.name
        kv_bytes_per_token = kv_bytes_per_token or inst.served_model.kv_bytes_per_token
    served = served or "baton-tiny"
    kv_bytes_per_token = kv_bytes_per_token or 4400
    records: list[RequestRecord] = []
    # Per record: its routing decision's (cached tokens, delta tokens, reason).
    decisions: list[tuple[int, int, str]] = []
    for _ in range(count):
        prompt = int(rng.lognormvariate(9.5, 0.8))
        low_hit = rng.random() < 0.25
        hit = rng.uniform(0.0, 0.9) if low_hit else rng.uniform(0.95, 1.0)
        cached = int(prompt * hit)
        out = max(1, int(rng.lognormvariate(5.3, 1.0)))
        delta = prompt - cached
        tpot = rng.uniform(0.02, 0.05)
        if low_hit:
            pipeline = PipelineChoice.P_RLD_MD
            handoff = rng.choice([HandoffChoice.ONE_SHOT, HandoffChoice.CATCH_UP])
            ttft = rng.lognormvariate(0.9, 0.5)
            by_rld = min(out - 1, int(rng.uniform(20, 120)))
            reason = (
                f"hit {hit:.0%} below threshold: relay decodes while {delta} tokens of KV cross"
            )
        else:
            pipeline = PipelineChoice.P_MD
            handoff = HandoffChoice.NONE
            ttft = rng.lognormvariate(1.4, 0.6)
            by_rld = 0
            reason = f"hit {hit:.0%}: small delta ({delta} tokens) goes straight to MD"
        # TTFT = prefill + KV wait (to the decoding role's first token); a relayed request's
        # handoff stalls its stream for about one recompute step.
        prefill = ttft * rng.uniform(0.3, 0.6)
        stall = tpot * rng.uniform(2.0, 6.0) if low_hit else tpot * rng.uniform(1.0, 1.5)
        status = RequestStatus.OK if rng.random() > 0.01 else RequestStatus.ERROR
        records.append(
            RequestRecord(
                request_id=f"syn-{uuid.uuid4().hex[:20]}",
                tenant=tenant,
                model=served,
                endpoint="chat.completions",
                stream=True,
                status=status,
                pipeline=pipeline,
                handoff_mode=handoff,
                handoff_at_token=by_rld if low_hit else None,
                handoff_batches=1 if low_hit else 0,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=out,
                tokens_by_rld=by_rld,
                # P makes output token 0 (its prefill's); the decoders the rest.
                tokens_by_md=out - 1 - by_rld,
                ttft_s=ttft,
                prefill_s=prefill,
                kv_wait_s=ttft - prefill,
                max_gap_s=stall,
                tpot_s=tpot,
                e2e_s=ttft + tpot * (out - 1),
                kv_bytes_wan=delta * kv_bytes_per_token,
                kv_bytes_intra_dc=prompt * kv_bytes_per_token if low_hit else 0,
                prefill_instance=_pick(rng, ids[InstanceRole.PREFILL]),
                relay_instance=_pick(rng, ids[InstanceRole.RELAY_DECODE]) if low_hit else "",
                main_instance=_pick(rng, ids[InstanceRole.MAIN_DECODE]),
            )
        )
        decisions.append((cached, delta, reason))
    for record in records:
        record.save()
    RoutingDecision.objects.bulk_create(
        RoutingDecision(
            request=r,
            policy_version=0,
            pipeline=r.pipeline,
            handoff_mode=r.handoff_mode,
            cached_tokens=cached,
            delta_tokens=delta,
            reason=f"[synthetic] {reason}",
        )
        for r, (cached, delta, reason) in zip(records, decisions, strict=True)
    )
    return records
