"""The PDD pipelines across agents, one module per role (this module re-exports them, so
`from agents.node.pipelines import ...` keeps working):

- `agents.node.prefill` (P): `admit_prefill`: prefill while MD pins its cached prefix (DRC);
  `agents.node.prefill_stream`: `run_prefill`, P's stream: ship the delta over the WAN to MD
  and, for p-rld-md, the full KV over the intra-DC fabric to RLD at the same time, and relay
  the token stream of RLD (or MD) to the caller (`PrefilledStream`, in named steps).
- `agents.node.relay` (RLD): `run_relay`, a `RelaySession` state machine (its phases and
  items in `agents.node.relay_phases`): decode at once, stream tokens, hand off to MD by token
  ids (one-shot or catch-up), relay MD's continuation; if MD or the WAN fails first, finish
  the request itself.
- `agents.node.decode` (MD): `run_main`: import the delta on top of the cached prefix (after
  the KV it counted on as in flight to it has landed, see `reserve_prefix` in
  `agents.node.decode_kv`), then decode (p-md) or wait held for the handoff batches and
  continue from the final one (p-rld-md).
- `agents.node.single`: `run_single`, the whole request on one engine (the baseline).
- `agents.node.pipeline_common`: what they share (events, KV payloads, stream pump, cancels).

Each yields NDJSON-ready event dicts; see agents/PROTOCOL.md, "Data plane"."""

from __future__ import annotations

from agents.node.decode import (
    SLOT_POLL_S,
    DecodeRequest,
    cache_late_kv,
    main_stream_closed,
    release_main,
    run_main,
    wait_for_decode_slot,
)
from agents.node.decode_kv import (
    Claim,
    claim_reservation,
    import_kv,
    reserve_prefix,
    start_import,
)
from agents.node.pipeline_common import (
    Events,
    OnClose,
    PeerFailed,
    cancel_local,
    cancel_remote,
    ensure_instance_worker,
    error_event,
    fire_and_forget,
    kv_payload,
    led_by,
    pump_stream,
    release_remote,
    sampling_json,
    token_event,
    transfer_id,
)
from agents.node.pipeline_common import quiet as _quiet
from agents.node.pipeline_common import settle as _settle
from agents.node.prefill import (
    PddRequest,
    Prefilled,
    admit_prefill,
    release_prefill,
    reserve_remote,
)
from agents.node.prefill_stream import run_prefill
from agents.node.relay import HANDOFF_SEND_GRACE_S, RelaySession, run_relay
from agents.node.relay_phases import Handoff, Phase, RelayRequest
from agents.node.single import admit_single, run_single

__all__ = [
    "HANDOFF_SEND_GRACE_S",
    "SLOT_POLL_S",
    "DecodeRequest",
    "Events",
    "OnClose",
    "PddRequest",
    "PeerFailed",
    "Phase",
    "Prefilled",
    "RelayRequest",
    "RelaySession",
    "Claim",
    "Handoff",
    "cache_late_kv",
    "_quiet",
    "_settle",
    "wait_for_decode_slot",
    "admit_prefill",
    "admit_single",
    "cancel_local",
    "cancel_remote",
    "claim_reservation",
    "ensure_instance_worker",
    "error_event",
    "fire_and_forget",
    "import_kv",
    "kv_payload",
    "led_by",
    "main_stream_closed",
    "pump_stream",
    "release_main",
    "release_prefill",
    "release_remote",
    "reserve_prefix",
    "reserve_remote",
    "run_main",
    "run_prefill",
    "run_relay",
    "run_single",
    "sampling_json",
    "start_import",
    "token_event",
    "transfer_id",
]
