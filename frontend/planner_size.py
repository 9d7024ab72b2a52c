"""The sizing section of the /planner/ page (``planner size``): operators start a sizing run,
everyone reads the latest runs and one run's answer (cheapest fleet with unit prices, max-BCR
fleet, band).

The page's JavaScript posts to the REST API (/api/v1/plans/sizing/, session + CSRF) and follows
the run; the form also posts here (``SizingStartView``), which works without JavaScript. The
section is rendered by the ``sizing_section`` tag (frontend/templatetags/planner_size.py), so the
planner page's own view is unchanged.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.mixins import LoginRequiredMixin
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import redirect
from django.urls import reverse, reverse_lazy
from django.views import View

from base.permissions import user_is_operator
from fleet.choices import PlanRunStatus
from plans import sizing
from plans.models import SizingRun
from plans.services import PlanInputError, plan_scenarios

RUNS_SHOWN = 10
MESSAGE_TAG = "sizing"


def _scenario_defaults(scenario: str) -> dict[str, Any]:
    """The scenario's own rate and SLA: the form's placeholders."""
    from planner.scenario import case_configs, load_scenario

    configs = case_configs(load_scenario(scenario))
    config = next(
        (c for c in configs.values() if c.get("fleet", {}).get("system") == "pdd"),
        next(iter(configs.values())),
    )
    sla = config.get("sla", {})
    return {
        "rps": config.get("workload", {}).get("rps"),
        "p90": sla.get("ttft_p90_s"),
        "p99": sla.get("ttft_p99_s"),
    }


def _pool_rows(
    counts: dict[str, int],
    unit_prices: dict[str, float],
    one_fewer: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per pool key ``role@datacenter:gpu``: count, unit price, cost per hour and,
    for the cheapest fleet, the check with one unit fewer (None: the pool is at its minimum)."""
    rows = []
    for key, count in counts.items():
        role, _, place = key.partition("@")
        datacenter, _, gpu = place.partition(":")
        price = unit_prices.get(gpu)
        rows.append(
            {
                "key": key,
                "role": role,
                "datacenter": datacenter,
                "gpu": gpu,
                "count": count,
                "unit_price": price,
                "cost": None if price is None else price * count,
                "fewer": (one_fewer or {}).get(key),
            }
        )
    return rows


def _band_line(band: dict[str, Any] | None) -> str:
    if not band:
        return ""
    from planner.bands import describe

    try:
        return describe("band", band)
    except (KeyError, TypeError, ValueError):  # an infinite figure is stored as null
        return ""


def sizing_answer(run: SizingRun | None) -> dict[str, Any] | None:
    """A done run's answer, ready for the template (None for none or an unfinished run)."""
    if run is None or run.status != PlanRunStatus.DONE or not run.result:
        return None
    result = run.result
    prices = result.get("unit_prices", {})
    cheapest = result.get("cheapest", {})
    best = (result.get("max_bcr") or {}).get("best")
    band = cheapest.get("band")
    return {
        "run": run,
        "rps": result.get("rps"),
        "sla": {k: v for k, v in result.get("sla", {}).items() if not k.startswith("_")},
        "unit_prices": prices,
        "found": cheapest.get("found", False),
        "reason": cheapest.get("reason", ""),
        "cheapest": cheapest,
        "cheapest_rows": _pool_rows(
            cheapest.get("counts", {}), prices, cheapest.get("one_fewer", {})
        ),
        "best": best,
        "best_rows": _pool_rows(best["counts"], prices) if best else [],
        "band": band,
        "band_line": _band_line(band),
        "runs": result.get("runs"),
        "wall_s": result.get("wall_s"),
        "method": result.get("method", ""),
    }


def sizing_context(request: HttpRequest | None, is_operator: bool) -> dict[str, Any]:
    """What the sizing section shows: the form's choices, the latest runs, one run's answer
    (``?size=<id>``, else the latest done run)."""
    runs = list(SizingRun.objects.select_related("created_by")[:RUNS_SHOWN])
    shown = None
    wanted = request.GET.get("size", "") if request is not None else ""
    if wanted.isdigit():
        shown = SizingRun.objects.filter(pk=int(wanted)).first()
    if shown is None:
        shown = SizingRun.objects.filter(status=PlanRunStatus.DONE).first()
    scenario = sizing.DEFAULT_SIZE_SCENARIO
    return {
        "is_operator": is_operator,
        "size_runs": runs,
        "size_shown": shown,
        "size_answer": sizing_answer(shown),
        "size_scenarios": plan_scenarios(),
        "size_default_scenario": scenario,
        "size_defaults": _scenario_defaults(scenario),
        "size_url": reverse("frontend:planner-size"),
    }


def _optional_number(value: str) -> float | str | None:
    value = (value or "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return value  # refused by sizing_inputs, naming the field


class SizingStartView(LoginRequiredMixin, View):
    """POST /planner/size/: the form without JavaScript. Operators start a run; the page then
    shows it (``/planner/?size=<id>#sizing``); bad input comes back as a message."""

    login_url = reverse_lazy("frontend:login")
    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> HttpResponse:
        if not user_is_operator(request.user):
            return HttpResponseForbidden("Only operators may start a sizing run.")
        form = request.POST
        values: dict[str, Any] = {
            "scenario": form.get("scenario") or sizing.DEFAULT_SIZE_SCENARIO,
            "rps": _optional_number(form.get("rps", "")),
            "p90": _optional_number(form.get("p90", "")),
            "p99": _optional_number(form.get("p99", "")),
            "from_db": form.get("from_db") in ("on", "true", "1"),
        }
        page = reverse("frontend:planner")
        try:
            run = sizing.sizing_run_create(**values, created_by=request.user)
        except PlanInputError as exc:
            messages.error(request, f"{exc.field}: {exc.message}", extra_tags=MESSAGE_TAG)
            return redirect(f"{page}#sizing")
        messages.success(request, f"Sizing run #{run.pk} queued.", extra_tags=MESSAGE_TAG)
        return redirect(f"{page}?size={run.pk}#sizing")
