"""Pages of the operator UI (thin: they read through selectors and the telemetry service)."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

from django.contrib.auth import views as auth_views
from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse_lazy
from django.utils import timezone
from django.views import View
from django.views.generic import TemplateView

from base.permissions import user_is_operator
from fleet.choices import PlanRunStatus
from fleet.models import FleetEvent, Instance, ServedModel, WANLink
from frontend.fleet_groups import (
    ROLE_SHORT,
    STATES,
    FleetFilter,
    filtered,
    fleet_rows,
    groups_of,
    price_map,
    totals_of,
)
from frontend.selectors import RequestLogFilter, request_log, topology_layout
from frontend.telemetry.fleet import engine_kind, link_name
from frontend.telemetry.histogram import RESOLUTION
from frontend.telemetry.snapshot import build_history, build_snapshot
from pdd.profiles import PROFILE_PREFIX
from plans.models import PlanRun
from plans.services import (
    DEFAULT_SCENARIO,
    MAX_COMBINATIONS,
    plan_scenarios,
    scenario_default_counts,
)
from routing.analysis import RELAYED_DESPITE_CACHE_THRESHOLD, relayed_despite_cache
from routing.models import RequestRecord

LOGIN_URL_NAME = "frontend:login"
LOGIN_URL = reverse_lazy(LOGIN_URL_NAME)


class LoginView(auth_views.LoginView):
    template_name = "frontend/login.html"
    redirect_authenticated_user = True
    next_page = "frontend:overview"  # a URL name: the view resolves it (resolve_url)


class LogoutView(auth_views.LogoutView):
    next_page = LOGIN_URL_NAME


def emulated_model_names() -> frozenset[str]:
    """Names of the served models whose source is a model profile (the emulated engine)."""
    return frozenset(
        ServedModel.objects.filter(source__startswith=PROFILE_PREFIX).values_list("name", flat=True)
    )


class PageView(LoginRequiredMixin, TemplateView):
    """A logged-in page; templates get ``is_operator`` and the active nav section."""

    login_url = LOGIN_URL
    section = ""
    # Pages that list served models by name get ``emulated_models``, to badge them.
    names_models = False

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        ctx["is_operator"] = user_is_operator(self.request.user)
        ctx["section"] = self.section
        if self.names_models:
            ctx["emulated_models"] = emulated_model_names()
        return ctx


class OverviewView(PageView):
    template_name = "frontend/overview.html"
    section = "overview"

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        ctx["bin_resolution_pct"] = round(RESOLUTION * 100, 1)
        return ctx


class FleetView(PageView):
    """The fleet at any size: the topology and a summary table by datacenter x role x GPU type
    (counts, states, load, cost), and a drill-down listing one group's nodes and instances, a
    page at a time (``?datacenter=&role=&gpu_type=``, optionally ``&state=`` or
    ``&engine=``). A fleet that fits on one drill-down page is listed whole without asking."""

    template_name = "frontend/fleet.html"
    section = "fleet"
    drill_page_size = 20
    drill_max_nodes = 40  # node chips shown in a drill-down; the rest are counted

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        rows = fleet_rows()
        groups = groups_of(rows)
        ctx["links"] = WANLink.objects.select_related("from_datacenter", "to_datacenter")
        ctx["topology"] = topology_layout(groups)
        ctx["groups"] = groups
        ctx["totals"] = totals_of(rows)
        ctx["states"] = [s.value for s in STATES]
        # a state column no instance is in is left out (the page shows it once one is)
        whole = ctx["totals"][-1] if ctx["totals"] else None
        ctx["show_emulated"] = bool(whole and whole.emulated)
        ctx["hidden_states"] = [
            s for s in ctx["states"] if s != "running" and (whole is None or not whole.states[s])
        ]
        ctx["fleet_data"] = {"states": ctx["states"], "prices": price_map(rows)}
        ctx["drill"] = self._drill(rows)
        return ctx

    def _drill(self, rows) -> dict | None:
        query = self.request.GET.copy()
        query.pop("page", None)
        if not query and not 0 < len(rows) <= self.drill_page_size:
            return None  # a large fleet: the summary only, until a group is picked
        form = FleetFilter(query)
        valid = form.is_valid()
        filters = {k: v for k, v in form.cleaned_data.items() if v and k != "all"}
        picked = filtered(rows, filters) if valid else []
        page = Paginator(picked, self.drill_page_size).get_page(self.request.GET.get("page"))
        nodes: dict[int, dict] = {}
        for row in picked:
            node = nodes.setdefault(
                row.node_id, {"hostname": row.node, "status": row.node_status, "instances": 0}
            )
            node["instances"] += 1
        node_list = sorted(nodes.values(), key=lambda n: n["hostname"])
        short = {"role": ROLE_SHORT.get(filters.get("role", ""), "")}
        title = " · ".join(
            short.get(k) or filters[k]
            for k in ("datacenter", "role", "gpu_type", "state", "engine")
            if filters.get(k)
        )
        return {
            "title": title or "All instances",
            "filters": filters,
            "closable": bool(query),
            "key": "|".join(filters.get(k, "") for k in ("datacenter", "role", "gpu_type")),
            "errors": []
            if valid
            else [f"{k}: {' '.join(map(str, v))}" for k, v in form.errors.items()],
            "count": len(picked),
            "emulated": sum(r.emulated for r in picked),
            "page": page,
            "query": query.urlencode(),
            "nodes": node_list[: self.drill_max_nodes],
            "nodes_total": len(node_list),
            "nodes_more": max(0, len(node_list) - self.drill_max_nodes),
        }


class RequestsView(PageView):
    template_name = "frontend/requests.html"
    section = "requests"
    names_models = True
    page_size = 50

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        form = RequestLogFilter(self.request.GET or None)
        filters = form.cleaned_data if form.is_valid() else {}
        records = request_log(filters=filters)
        page = Paginator(records, self.page_size).get_page(self.request.GET.get("page"))
        page.object_list = list(page.object_list)
        query = self.request.GET.copy()
        query.pop("page", None)
        # Relayed requests MD had in fact cached over 90% of (routing.analysis).
        held, relayed = relayed_despite_cache(records)
        ctx.update(
            form=form,
            page=page,
            query=query.urlencode(),
            relayed_despite_cache=held,
            relayed_total=relayed,
            relayed_threshold=RELAYED_DESPITE_CACHE_THRESHOLD,
        )
        return ctx


class RequestDetailView(PageView):
    """One request: its timeline, routing decision, the inputs the policy saw and its usage
    entry. Logged-in users only (operators and viewers), like the request log."""

    template_name = "frontend/request_detail.html"
    section = "requests"
    names_models = True

    def get_context_data(self, **kwargs):
        from billing.models import UsageEntry
        from frontend.timeline import attempts, request_timeline
        from routing.models import RoutingDecision

        ctx = super().get_context_data(**kwargs)
        record = get_object_or_404(
            RequestRecord.objects.select_related("tenant"), request_id=kwargs["request_id"]
        )
        decision = RoutingDecision.objects.filter(request=record).first()
        inputs = (
            decision.inputs if decision is not None and isinstance(decision.inputs, dict) else {}
        )
        ctx.update(
            r=record,
            decision=decision,
            timeline=request_timeline(record, decision),
            attempts=attempts(decision),
            inputs_json=json.dumps(inputs, indent=2, sort_keys=True, default=str),
            input_instances=sorted(
                (inputs.get("instances") or {}).items(),
                key=lambda kv: (str(kv[1].get("role")), kv[0]),
            ),
            input_links=sorted((inputs.get("wan_links") or {}).items()),
            input_scalars=[
                (k, v) for k, v in sorted(inputs.items()) if not isinstance(v, (dict, list))
            ],
            usage=UsageEntry.objects.filter(request_id=record.request_id).first(),
            instances=_instances(record),
        )
        return ctx


def _instances(record) -> list[tuple[str, str, int | None]]:
    """(role, instance id, pk if it is still an instance of the fleet) for P, RLD and MD."""
    roles = [
        ("P", record.prefill_instance),
        ("RLD", record.relay_instance),
        ("MD", record.main_instance),
    ]
    pks = [int(v) for _, v in roles if v.isdigit()]
    known = set(Instance.objects.filter(pk__in=pks).values_list("pk", flat=True))
    return [(role, v, int(v) if v.isdigit() and int(v) in known else None) for role, v in roles]


class InstanceDetailView(PageView):
    template_name = "frontend/instance_detail.html"
    section = "fleet"

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        instance = get_object_or_404(
            Instance.objects.select_related(
                "node", "node__datacenter", "node__gpu_type", "served_model"
            ),
            pk=kwargs["pk"],
        )
        ctx["instance"] = instance
        ctx["engine"] = engine_kind(
            instance.last_report, instance.node.last_report, instance.served_model.source
        )
        ctx["events"] = FleetEvent.objects.filter(instance=instance)[:30]
        ctx["recent"] = request_log(filters={"instance": str(instance.pk)})[:20]
        return ctx


class LinkDetailView(PageView):
    template_name = "frontend/link_detail.html"
    section = "fleet"

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        link = get_object_or_404(
            WANLink.objects.select_related("from_datacenter", "to_datacenter"), pk=kwargs["pk"]
        )
        ctx["link"] = link
        ctx["link_name"] = link_name(link.from_datacenter.name, link.to_datacenter.name)
        return ctx


FAVICON = Path(__file__).resolve().parent / "static" / "frontend" / "favicon.svg"


def favicon_view(request: HttpRequest) -> HttpResponse:
    """/favicon.ico for pages that name no icon (the admin, the API docs, JSON): the UI's SVG
    icon, so browsers get no 404."""
    response = HttpResponse(FAVICON.read_bytes(), content_type="image/svg+xml")
    response["Cache-Control"] = "public, max-age=86400"
    return response


class SnapshotJSONView(LoginRequiredMixin, View):
    """The same snapshot the websocket pushes, for scripts and for pages without a socket."""

    login_url = LOGIN_URL

    def get(self, request: HttpRequest) -> JsonResponse:
        return JsonResponse(build_snapshot())


class HistoryJSONView(LoginRequiredMixin, View):
    """Chart points: ``?scale=live`` (5 min by the second) or ``?scale=day`` (by the minute)."""

    login_url = LOGIN_URL

    def get(self, request: HttpRequest) -> JsonResponse:
        scale = "day" if request.GET.get("scale") == "day" else "live"
        return JsonResponse(build_history(scale=scale))


class PlannerView(PageView):
    """What-if capacity planning: operators queue plans over the fleet; everyone reads them."""

    template_name = "frontend/planner.html"
    section = "planner"

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        ctx["runs"] = PlanRun.objects.select_related("created_by")[:20]
        ctx["latest"] = PlanRun.objects.filter(status=PlanRunStatus.DONE).first()
        ctx["scenarios"] = plan_scenarios()
        ctx["default_scenario"] = DEFAULT_SCENARIO
        ctx["max_combinations"] = MAX_COMBINATIONS
        ctx["defaults"] = {
            k: ",".join(map(str, v)) for k, v in scenario_default_counts(DEFAULT_SCENARIO).items()
        }
        return ctx


class BillingView(PageView):
    """Billing for operators and viewers: tenants' spend this period (their open statements),
    spend and tokens per day, the period's statements with their lines, and cost vs revenue
    and margin per model (billing.margin). ``?period=YYYY-MM``; default the current month."""

    template_name = "frontend/billing.html"
    section = "billing"
    names_models = True

    def get_context_data(self, **kwargs):
        from billing import statements as billing_statements
        from billing.margin import margin
        from billing.models import Statement, StatementStatus

        ctx = super().get_context_data(**kwargs)
        now = timezone.now()
        try:
            start, end = billing_statements.parse_month(self.request.GET.get("period", ""))
        except ValueError:
            start = billing_statements.month_start(now)
            end = billing_statements.next_month(start)
        found = list(
            Statement.objects.filter(period_start=start)
            .select_related("tenant")
            .prefetch_related("lines")
            .order_by("tenant__name")
        )
        rows = []
        for st in found:
            lines = list(st.lines.all())
            st.line_list = lines
            st.total_list = billing_statements.totals(lines)
            st.requests = sum(line.requests for line in lines)
            st.tokens = sum(
                line.input_tokens + line.cached_tokens + line.output_tokens for line in lines
            )
            if st.status == StatementStatus.OPEN or end <= now:
                rows.append(st)  # this period's open ones; a past period's closed ones too
        report = margin(start, end, now=now)
        daily: dict[str, dict] = {}
        for line in report.per_day:
            day = daily.setdefault(
                line["day"].isoformat(), {"spend": Decimal(0), "cost": Decimal(0), "tokens": 0}
            )
            day["spend"] += line["revenue"]
            day["cost"] += line["cost"]
            day["tokens"] += line["tokens"]
        currencies = sorted({t["currency"] for t in report.totals})
        ctx.update(
            period=start.strftime("%Y-%m"),
            period_start=start,
            period_end=end,
            previous_period=billing_statements.month_start(start - timedelta(days=1)).strftime(
                "%Y-%m"
            ),
            next_period=end.strftime("%Y-%m"),
            open_statements=rows,
            open_count=sum(st.status == StatementStatus.OPEN for st in found),
            statements=found,
            margin=report,
            cost_pools=report.cost.by_pool(),
            cost_totals=report.cost.totals(report.cost.by_pool()),
            chart_currency=",".join(currencies) or "USD",
            chart_data={
                "days": sorted(daily),
                "spend": [float(daily[d]["spend"]) for d in sorted(daily)],
                "cost": [float(daily[d]["cost"]) for d in sorted(daily)],
                "tokens": [daily[d]["tokens"] for d in sorted(daily)],
            },
        )
        return ctx


class UsageDetailView(PageView):
    """One request's ledger line, its price in force and what it adds to its statement line
    (full precision: statement lines round once, per line, not per request)."""

    template_name = "frontend/usage_detail.html"
    section = "billing"

    def get(self, request, *args, **kwargs):
        ctx = self.get_context_data(**kwargs)
        return self.render_to_response(ctx, status=200 if ctx["entry"] else 404)

    def get_context_data(self, **kwargs):
        from billing.models import ModelPrice, UsageEntry
        from billing.rating import component, with_price

        ctx = super().get_context_data(**kwargs)
        ctx["request_id"] = kwargs["request_id"]
        entry = (
            with_price(UsageEntry.objects.filter(request_id=kwargs["request_id"]))
            .select_related("tenant", "api_key", "statement")
            .first()
        )
        ctx["entry"] = entry
        if entry is not None:
            price = ModelPrice.objects.filter(pk=entry.price_ref).first()
            uncached = entry.prompt_tokens - entry.cached_tokens
            parts = [
                ("uncached input", uncached, price and price.input_per_mtok),
                ("cached input", entry.cached_tokens, price and price.cached_input_per_mtok),
                ("output", entry.completion_tokens, price and price.output_per_mtok),
            ]
            ctx["price"] = price
            ctx["parts"] = [
                {"what": what, "tokens": n, "per_mtok": p, "amount": component(n, p)}
                for what, n, p in parts
            ]
            ctx["amount"] = sum((part["amount"] for part in ctx["parts"]), Decimal(0))
        return ctx
