"""Command line of the node agent: `python -m agents serve` and `python -m agents loopback`.

Nothing here imports torch at module level: `serve` sets the engine's thread budget and
OpenMP wait policy in the environment first (agents/node/settings.py, resolve_thread_plan)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from agents.node.settings import (
    DECODE_WEIGHTS,
    DTYPES,
    ROLES,
    WAIT_POLICIES,
    apply_thread_plan,
    host_cores,
    load_settings,
    read_config,
    resolve_thread_plan,
)
from pdd.dataplane import ENV as DATA_TOKEN_ENV
from pdd.vocab import HandoffMode, Pipeline


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run one node agent")
    p.add_argument("--config", help="JSON file with settings (flags override it)")
    p.add_argument("--role", choices=ROLES, help="standalone: start instance 0 with this role")
    p.add_argument("--model", help="instance 0's model: baton-tiny or a checkpoint folder")
    p.add_argument("--datacenter")
    p.add_argument("--node", help="node name (hostname) reported to the control plane")
    p.add_argument("--listen", help="HOST:PORT of the HTTP API")
    p.add_argument("--kv-listen", help="HOST:PORT of the intra-DC KV fabric (port 0: free)")
    p.add_argument("--wan-port", type=int, help="port of the WAN KV fabric (0: free)")
    p.add_argument(
        "--link",
        action="append",
        dest="links",
        help="WAN link to a peer datacenter: PEER_DC=GBPS:RTT_MS[:POOL] (repeatable)",
    )
    p.add_argument(
        "--control-plane",
        help="control plane URL; the node's agent token comes from --token-file, "
        "$BATON_AGENT_TOKEN_FILE or $BATON_AGENT_TOKEN",
    )
    p.add_argument(
        "--token-file",
        help="file holding this node's agent token (default: $BATON_AGENT_TOKEN_FILE)",
    )
    p.add_argument(
        "--token",
        help="this node's agent token (deprecated: visible to every user in `ps`; use "
        "--token-file or $BATON_AGENT_TOKEN)",
    )
    p.add_argument(
        "--data-token-file",
        help="file holding the fleet-wide data-plane token (default: $BATON_DATA_TOKEN_FILE)",
    )
    p.add_argument(
        "--data-token",
        help="fleet-wide data-plane token peers and the gateway must send "
        "(default: $BATON_DATA_TOKEN; a control plane may hand it out at registration)",
    )
    p.add_argument("--advertise-url", help="HTTP URL peers reach this agent at")
    p.add_argument(
        "--advertise-wan-port",
        type=int,
        help="WAN fabric port peers in other datacenters reach (NAT, a port forward, a proxy); "
        "default: the port bound",
    )
    p.add_argument("--heartbeat-interval-s", type=float)
    p.add_argument("--drain-grace-s", type=float, help="SIGTERM: wait this long for requests")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads of this agent's engines (default: $BATON_AGENT_THREADS, else the "
        "host's cores // --agents-per-host, at least 1)",
    )
    p.add_argument(
        "--agents-per-host",
        type=int,
        help="agents sharing this host's cores (default: $BATON_AGENTS_PER_HOST, else 1)",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=WAIT_POLICIES,
        help="how OpenMP's idle threads wait: passive sleeps, active spins; auto (default, "
        "$BATON_OMP_WAIT_POLICY): an OMP_WAIT_POLICY in the environment, else passive where "
        "cores are shared (several agents, more threads than cores, or $CI), else active",
    )
    p.add_argument(
        "--device",
        help="where engines run: cpu, cuda or cuda:N (default: $BATON_ENGINE_DEVICE, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the engines' weights and KV cache dtype (default float32)",
    )
    p.add_argument(
        "--decode-weights",
        choices=DECODE_WEIGHTS,
        help="weights decode steps multiply by: full (the model's own, default), int8 "
        "(weight-only int8 copies) or stream (the skinny kernel's packed copies, for x86 CPUs "
        "with AVX-512 and AVX512-BF16); int8 and stream: CPU only",
    )
    p.add_argument(
        "--decode-compile",
        action="store_true",
        default=None,
        help="decode steps through torch.compile: needs a C++ compiler, compiles for tens of "
        "seconds on an instance's first steps; faster at larger batches (bench/engine/REPORT.md)",
    )
    p.add_argument(
        "--kv-scale",
        type=float,
        help="emulated instances: KV bytes on the wire = real bytes / this, WAN links shaped "
        "to bandwidth / this (>= 1; default 1; an agent above 1 hosts emulated instances only)",
    )
    p.add_argument(
        "--gpu",
        type=_json_object,
        help='standalone: the GPU unit of instance 0, as JSON: {"name": "H100", "count": 8, '
        '"peak_bf16_tflops": 989, "memory_gib": 80, "memory_bandwidth_gbps": 3350, '
        '"interconnect_gbps": 50} (per chip; required with --model profile:...)',
    )
    p.add_argument(
        "--speedup",
        type=float,
        help="emulated instances: modelled step times are divided by this (default 1)",
    )
    p.add_argument("--num-blocks", type=int, help="KV blocks per engine instance")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-running", type=int)
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        help="new tokens one forward may process: the chunked prefill's chunk (default 2048)",
    )
    p.add_argument("--max-queued", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--kv-timeout-s", type=float)
    p.add_argument("--handoff-timeout-s", type=float)
    p.add_argument(
        "--handoff-ack-floor-s",
        type=float,
        help="final handoff: wait for MD's acknowledgement this long plus 4 x the link RTT "
        "(at most --handoff-timeout-s; default 1.5)",
    )
    p.add_argument(
        "--reserve-timeout-s",
        type=float,
        help="P waits this long for MD's prefix reservation (default 3); then p-rld-md goes on "
        "with RLD alone and p-md fails over",
    )
    p.add_argument(
        "--handoff-attach-s",
        type=float,
        help="MD keeps a stream RLD handed to a direct caller this long for its attach "
        "(default 10)",
    )
    p.add_argument(
        "--kv-stream-tokens",
        type=int,
        help="P sends MD's KV in pieces of at least this many tokens while prefill runs "
        "(streamed export; default 0: all of it after prefill)",
    )
    p.add_argument(
        "--queued-every-s",
        type=float,
        help="P's stream says 'queued' this often while a request waits in its engine's queue "
        "for its first token (default 5), so a busy P is not taken for a frozen one",
    )
    p.add_argument("--log-level", default="WARNING")


def _loopback_parser(sub) -> None:
    p = sub.add_parser("loopback", help="run one request through P, RLD and MD on loopback")
    p.add_argument(
        "--pipeline",
        choices=("single", Pipeline.P_MD, Pipeline.P_RLD_MD),
        default=Pipeline.P_RLD_MD,
    )
    p.add_argument(
        "--handoff",
        choices=(HandoffMode.ONE_SHOT, HandoffMode.CATCH_UP),
        default=HandoffMode.ONE_SHOT,
    )
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--cached-len", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--wan-gbps", type=float, default=1.0)
    p.add_argument("--wan-rtt-ms", type=float, default=20.0)
    p.add_argument("--wan-pool", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--catch-up-batch", type=int, default=64)
    p.add_argument("--handoff-at", type=int, default=0, help="RLD tokens before the handoff")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--md-datacenter",
        choices=("dc-a", "dc-b"),
        default="dc-b",
        help="MD's datacenter: dc-b behind the WAN link (default), or dc-a, P's own, where P "
        "ships it the KV over the intra-DC fabric (in-DC PD)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (always JSON)")


def _read_secret(path: str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"the {what} file {path} is empty")
    return value


def agent_secrets(flags: dict, environ) -> dict[str, str | None]:
    """The agent token and the data-plane token, from a file or the environment; never left
    in the flags (``--token-file`` / ``--data-token-file`` are consumed here).

    Agent token: ``--token`` (deprecated: on the command line every local user sees it in
    ``ps``), else ``--token-file``, ``$BATON_AGENT_TOKEN_FILE``, ``$BATON_AGENT_TOKEN``.
    Data token: ``--data-token``, ``--data-token-file``, ``$BATON_DATA_TOKEN_FILE``,
    ``$BATON_DATA_TOKEN``. Unset everywhere: None (the config file may still give one).
    """
    token_file = flags.pop("token_file", None) or environ.get("BATON_AGENT_TOKEN_FILE")
    data_file = flags.pop("data_token_file", None) or environ.get("BATON_DATA_TOKEN_FILE")
    token = flags.get("token")
    if token is not None:
        print(
            "warning: --token puts the agent token on the command line, where `ps` shows it "
            "to every user; use --token-file or $BATON_AGENT_TOKEN",
            file=sys.stderr,
        )
    elif token_file:
        token = _read_secret(token_file, "agent token")
    else:
        token = environ.get("BATON_AGENT_TOKEN") or None
    data_token = flags.get("data_token")
    if data_token is None:
        data_token = (
            _read_secret(data_file, "data token")
            if data_file
            else environ.get(DATA_TOKEN_ENV) or None
        )
    return {"token": token, "data_token": data_token}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _loopback_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "log_level")}
        try:
            secrets = agent_secrets(flags, os.environ)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        flags.update(secrets)
        try:
            plan = resolve_thread_plan(flags, read_config(args.config), os.environ, host_cores())
            # Before torch loads (agents.node.serve imports it): OpenMP reads these once.
            plan = apply_thread_plan(plan)
            flags.update(
                threads=plan.torch_threads,
                agents_per_host=plan.agents_per_host,
                omp_wait_policy=plan.omp_wait_policy,
            )
            settings = load_settings(args.config, flags)
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        settings.thread_plan = plan
        print(plan.line(), file=sys.stderr, flush=True)
        from agents.node.serve import serve

        return asyncio.run(serve(settings))
    from agents.node.loopback import run_loopback

    result = run_loopback(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if not result.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
