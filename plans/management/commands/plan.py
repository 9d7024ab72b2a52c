"""Search P / RLD / MD node counts for the best BCR on the fleet in the database, in-process."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from plans import services

FLAGS = {
    "scenario": "--scenario",
    "prefill_counts": "--prefill",
    "relay_counts": "--relay",
    "main_counts": "--main",
    "counts": "--prefill x --relay x --main",
    "duration_s": "--duration",
}


def _counts(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(
            f"--{flag}: expected comma-separated whole numbers, got {text!r}"
        ) from None


class Command(BaseCommand):
    help = (
        "Capacity plan over the fleet in the database: GPU types, unit prices in force, "
        "datacenters and the WAN link from the database; model, engine, workload, SLA and "
        "policy from a planner scenario. Counts are nodes; omitted ones default to the "
        "scenario's own search space."
    )

    def add_arguments(self, parser):
        parser.add_argument("--scenario", default=services.DEFAULT_SCENARIO)
        parser.add_argument("--prefill", help="prefill node counts to try, e.g. 2,4")
        parser.add_argument("--relay", help="relay-decode node counts to try, e.g. 1")
        parser.add_argument("--main", help="main-decode node counts to try, e.g. 1,2")
        parser.add_argument("--top", type=int, default=5, help="best configurations to show")
        parser.add_argument(
            "--duration", type=float, help="simulated workload seconds (default: the scenario's)"
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    def handle(self, *args, **opts):
        given = {
            "prefill_counts": _counts("prefill", opts["prefill"]),
            "relay_counts": _counts("relay", opts["relay"]),
            "main_counts": _counts("main", opts["main"]),
        }
        if not 1 <= opts["top"] <= services.MAX_TOP:
            raise CommandError(f"--top: must be 1..{services.MAX_TOP}, got {opts['top']}")
        try:
            defaults = services.scenario_default_counts(opts["scenario"])
            counts = {k: v if v is not None else defaults[k] for k, v in given.items()}
            inputs = services.plan_inputs_from_fleet(
                scenario=opts["scenario"], duration_s=opts["duration"], **counts
            )
            results = services.plan_inputs_run(inputs=inputs, top=opts["top"])
        except services.PlanInputError as exc:
            flag = FLAGS.get(exc.field, exc.field)
            if exc.field in given and given[exc.field] is None:
                flag += f" (default from scenario {opts['scenario']!r})"
            raise CommandError(f"{flag}: {exc.message}") from exc
        except ValueError as exc:
            raise CommandError(str(exc).splitlines()[0]) from exc
        if opts["json"]:
            out = {k: inputs[k] for k in ("scenario", "currency", "gpus_per_node", "notes")}
            self.stdout.write(json.dumps({**out, "results": results}, indent=1))
            return
        self._table(inputs, results)

    def _table(self, inputs, results) -> None:
        pools = {p["role"]: p for p in inputs["search_space"]["pools"]}
        per_node = inputs["gpus_per_node"]
        for role, label in (("prefill", "P"), ("relay_decode", "RLD"), ("main_decode", "MD")):
            pool = pools[role]
            gpu = inputs["fleet_spec"]["gpu_types"][pool["gpu"]]
            self.stdout.write(
                f"{label:>3} in {pool['datacenter']}: {pool['gpu']}, {per_node[role]} GPUs/node, "
                f"{gpu['unit_price']:.2f} {inputs['currency']}/node-h, "
                f"trying {','.join(map(str, pool['counts']))} nodes"
            )
        for note in inputs["notes"]:
            self.stdout.write(f"note: {note}")
        if not results:
            self.stdout.write("No servable configuration (each needs prefill and main decode).")
            return
        cur = inputs["currency"]
        head = (
            f"{'#':>2} {'P':>5} {'RLD':>5} {'MD':>5} {'goodput req/s':>14} "
            f"{f'cost {cur}/h':>12} {'BCR':>9} {'TTFT p90 s':>11}"
        )
        self.stdout.write(head)
        self.stdout.write("-" * len(head))
        for i, r in enumerate(results, start=1):
            n = r["nodes"]
            ttft = ((r.get("summary") or {}).get("ttft_s") or {}).get("p90")
            self.stdout.write(
                f"{i:>2} {n['prefill']:>5} {n['relay_decode']:>5} {n['main_decode']:>5} "
                f"{r['goodput_rps']:>14.2f} {r['cost_per_hour']:>12.2f} {r['bcr']:>9.4f} "
                f"{'-' if ttft is None else f'{ttft:.2f}':>11}"
            )
        self.stdout.write(f"BCR = goodput req/s per {cur}/h; counts are nodes.")
