"""Tenant self-service, authenticated with the tenant's own API key (``Authorization: Bearer
sk-baton-...``), shaped like OpenAI's organization usage API; a key only ever sees its tenant.

    GET /v1/organization/usage/completions?start_time=<unix s>[&end_time=][&bucket_width=1d]
        [&group_by=model&group_by=api_key_id][&models=...][&api_key_ids=...][&limit=7][&page=]
    GET /v1/organization/statements[?status=open|closed][&period=YYYY-MM]
    GET /v1/organization/statements/<id>          (JSON with lines)
    GET /v1/organization/statements/<id>/csv      (text/csv)
    GET /v1/organization/statements/range?start_time=<unix s>[&end_time=]   (any range, JSON)
    GET /v1/organization/statements/range/csv?start_time=...[&end_time=]    (the same, CSV)

Usage buckets are UTC days. As in OpenAI's API, ``input_tokens`` counts every prompt token,
cached ones included, and ``input_cached_tokens`` is the cached part of it. Errors use the
OpenAI error shape, as the gateway's do (``pdd.openai_errors``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import Count, Sum
from django.db.models.functions import TruncDay
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from base.filters import INT64_MAX
from billing import statements
from billing.api.serializers import (
    StatementSerializer,
    StatementSummarySerializer,
    statement_csv,
)
from billing.models import ApiKey, Statement, StatementStatus, UsageEntry
from billing.services import api_key_authenticate
from pdd.openai_errors import OpenAIError, bad_request, unauthorized

DAY = timedelta(days=1)
GROUPS = {"model": "model", "api_key_id": "api_key__prefix"}
DEFAULT_LIMIT, MAX_LIMIT = 7, 31
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(2999, 12, 31, tzinfo=UTC)


def _key(request: HttpRequest) -> ApiKey:
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    key = api_key_authenticate(raw.strip())
    if key is None:
        raise unauthorized("Invalid, revoked or inactive API key.")
    return key


def _handled(view):
    @require_GET
    def wrapper(request: HttpRequest, *args, **kwargs):
        try:
            return view(request, _key(request), *args, **kwargs)
        except OpenAIError as exc:
            return JsonResponse(exc.body(), status=exc.status)

    wrapper.__name__ = view.__name__
    wrapper.__doc__ = view.__doc__
    return wrapper


def _unix(request: HttpRequest, name: str, default: datetime | None = None) -> datetime:
    raw = request.GET.get(name)
    if raw is None or raw == "":
        if default is None:
            raise bad_request(f"'{name}' is required (Unix seconds).", param=name)
        return default
    try:
        value = datetime.fromtimestamp(int(raw), tz=UTC)
    except (ValueError, OverflowError, OSError):
        raise bad_request(f"'{name}' must be Unix seconds.", param=name) from None
    if not EARLIEST <= value <= LATEST:
        raise bad_request(f"'{name}' is out of range.", param=name)
    return value


def _many(request: HttpRequest, name: str) -> list[str]:
    values = request.GET.getlist(name) + request.GET.getlist(f"{name}[]")
    if any("\x00" in value for value in values):  # PostgreSQL text cannot hold NUL: a 500
        raise bad_request(f"'{name}' may not contain NUL characters.", param=name)
    return [part for value in values for part in value.split(",") if part]


def _ts(when: datetime) -> int:
    return int(when.timestamp())


@_handled
def usage_completions(request: HttpRequest, key: ApiKey) -> JsonResponse:
    """Daily buckets of the tenant's requests and input, cached input and output tokens."""
    start = _unix(request, "start_time")
    end = _unix(request, "end_time", default=timezone.now())
    if end <= start:
        raise bad_request("'end_time' must be later than 'start_time'.", param="end_time")
    if request.GET.get("bucket_width", "1d") != "1d":
        raise bad_request("Only bucket_width=1d is supported.", param="bucket_width")
    group_by = _many(request, "group_by")
    unknown = sorted(set(group_by) - set(GROUPS))
    if unknown:
        raise bad_request(f"Cannot group by {', '.join(unknown)}.", param="group_by")
    try:
        limit = int(request.GET.get("limit", DEFAULT_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"'limit' must be 1 to {MAX_LIMIT}.", param="limit")
    first = datetime(start.year, start.month, start.day, tzinfo=UTC)
    if request.GET.get("page"):
        page = _unix(request, "page")
        if page < first or page >= end or (page - first) % DAY:
            raise bad_request("Unknown page.", param="page")
        first = page
    last = min(first + limit * DAY, end)  # exclusive: the buckets of this page end there

    entries = UsageEntry.objects.filter(
        tenant_id=key.tenant_id, created_at__gte=max(start, first), created_at__lt=last
    )
    if models := _many(request, "models"):
        entries = entries.filter(model__in=models)
    if prefixes := _many(request, "api_key_ids"):
        entries = entries.filter(api_key__prefix__in=prefixes)
    columns = [GROUPS[name] for name in group_by]
    rows = (
        entries.order_by()
        .annotate(day=TruncDay("created_at", tzinfo=UTC))
        .values("day", *columns)
        .annotate(
            input_tokens=Sum("prompt_tokens"),
            input_cached_tokens=Sum("cached_tokens"),
            output_tokens=Sum("completion_tokens"),
            num_model_requests=Count("pk"),
        )
        .order_by("day", *columns)
    )
    by_day: dict[int, list[dict]] = {}
    for row in rows:
        by_day.setdefault(_ts(row["day"]), []).append(
            {
                "object": "organization.usage.completions.result",
                "input_tokens": row["input_tokens"],
                "input_cached_tokens": row["input_cached_tokens"],
                "output_tokens": row["output_tokens"],
                "num_model_requests": row["num_model_requests"],
                "project_id": None,
                "user_id": None,
                "api_key_id": row.get("api_key__prefix") if "api_key_id" in group_by else None,
                "model": row.get("model") if "model" in group_by else None,
                "batch": None,
            }
        )
    data = []
    day = first
    while day < last:
        data.append(
            {
                "object": "bucket",
                "start_time": _ts(day),
                "end_time": _ts(day + DAY),
                "results": by_day.get(_ts(day), []),
            }
        )
        day += DAY
    has_more = last < end
    return JsonResponse(
        {
            "object": "page",
            "data": data,
            "has_more": has_more,
            "next_page": str(_ts(last)) if has_more else None,
        }
    )


def _own_statements(key: ApiKey):
    return Statement.objects.filter(tenant_id=key.tenant_id).select_related("tenant")


@_handled
def statement_list(request: HttpRequest, key: ApiKey) -> JsonResponse:
    """The tenant's statements, newest first, without lines."""
    found = _own_statements(key)
    status = request.GET.get("status")
    if status:
        if status not in StatementStatus.values:
            raise bad_request("'status' must be open or closed.", param="status")
        found = found.filter(status=status)
    period = request.GET.get("period")
    if period:
        try:
            start, _ = statements.parse_month(period)
        except ValueError as exc:
            raise bad_request(f"'period': {exc}", param="period") from None
        found = found.filter(period_start=start)
    found = found.prefetch_related("lines").order_by("-period_start")[:120]
    data = StatementSummarySerializer(found, many=True).data
    return JsonResponse({"object": "list", "data": data, "has_more": False})


def _own_statement(key: ApiKey, statement_id: str) -> Statement:
    """The tenant's statement `statement_id` (the URL's segment, any text); a 404 for an id
    that is not a number, is out of range, missing, or another tenant's."""
    statement = None
    if statement_id.isascii() and statement_id.isdigit() and int(statement_id) <= INT64_MAX:
        statement = (
            _own_statements(key).prefetch_related("lines").filter(pk=int(statement_id)).first()
        )
    if statement is None:  # another tenant's statement is as absent as a missing one
        raise OpenAIError(404, "No such statement.", param="statement_id", code="not_found")
    return statement


@_handled
def statement_detail(request: HttpRequest, key: ApiKey, statement_id: str) -> JsonResponse:
    """One of the tenant's statements with its lines."""
    return JsonResponse(StatementSerializer(_own_statement(key, statement_id)).data)


@_handled
def statement_csv_view(request: HttpRequest, key: ApiKey, statement_id: str) -> HttpResponse:
    """One of the tenant's statements as CSV."""
    statement = _own_statement(key, statement_id)
    body = statement_csv(StatementSerializer(statement).data)
    return HttpResponse(body, content_type="text/csv; charset=utf-8")


MAX_RANGE = timedelta(days=366)


def _own_range(request: HttpRequest, key: ApiKey) -> statements.Preview:
    start = _unix(request, "start_time")
    end = _unix(request, "end_time", default=timezone.now())
    if end <= start:
        raise bad_request("'end_time' must be later than 'start_time'.", param="end_time")
    if end - start > MAX_RANGE:
        raise bad_request("The range may span at most 366 days.", param="end_time")
    return statements.preview(tenant=key.tenant, start=start, end=end)


@_handled
def statement_range(request: HttpRequest, key: ApiKey) -> JsonResponse:
    """The tenant's statement for any [start_time, end_time): lines and totals worked out
    from its usage by request time (status ``preview``, no id)."""
    return JsonResponse(StatementSerializer(_own_range(request, key)).data)


@_handled
def statement_range_csv(request: HttpRequest, key: ApiKey) -> HttpResponse:
    """The same as CSV."""
    body = statement_csv(StatementSerializer(_own_range(request, key)).data)
    return HttpResponse(body, content_type="text/csv; charset=utf-8")


def unknown_url(request: HttpRequest, rest: str) -> JsonResponse:
    """Any other path under /v1/organization/: a 404 in OpenAI's shape (as OpenAI answers an
    unknown URL), not Django's HTML page."""
    error = OpenAIError(404, f"Invalid URL ({request.method} {request.path}).")
    return JsonResponse(error.body(), status=error.status)
