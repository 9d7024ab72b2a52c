"""Provider cost: what the fleet cost over a period, from GPU-hours and the unit price book.

An instance costs money while it is *running*. Its running intervals come from its
``instance.state`` fleet events (``data = {"previous", "new"}``): a change to ``running`` opens
an interval, any change away from it closes it. An instance whose last change before ``start``
was to ``running`` counts from ``start``; one still running counts up to ``min(end, now)``.
An instance with no ``instance.state`` event at all (rows seeded or imported without going
through an agent) that is ``running`` now counts from its ``state_changed_at`` (else its
``created_at``). ``draining`` is a change away from ``running`` and is not costed.
Deleting an instance unlinks its events, so just before the delete its running intervals are
kept in ``billing.DeletedInstanceRun`` (with its model, GPU type, datacenter and GPU count)
and costed from there: the cost of the past does not change when an instance is deleted.

Each interval costs ``GPU-hours x gpu_count x price_per_gpu_hour`` with the ``fleet.UnitPrice``
in force for the node's (GPU type, datacenter); an interval is split wherever a price starts or
ends, and at UTC midnight for the per-day breakdown. Time with no price in force is reported as
unpriced GPU-hours (amount 0), as billing/rating.py does with unpriced usage.

**Rounding rule.** Time is counted in whole microseconds, so a piece's cost
``GPU-microseconds x price / 3.6e9`` is an exact rational; the GPU-microseconds x price products
are summed exactly per reported line and divided once, and each line's amount is rounded once
to the currency's minor unit (0.01) with ``ROUND_HALF_EVEN`` (billing.amounts.round_amount).
GPU-hours are shown rounded half-even to 6 decimals. A total (per currency) is the sum of the
rounded lines it is the total of; lines of different breakdowns (per pool, per model, per model
and day) are each rounded on their own, so their sums may differ by a cent or so.

frontend/telemetry/fleet.py ``fleet_cost_per_hour`` prices the fleet *now* (float, for the live
dashboard and the live BCR); it cannot price the past, so this module does not reuse it, but it
matches instances to prices the same way: (node GPU type, node datacenter) -> UnitPrice.
"""

from __future__ import annotations

import decimal
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django.db.models import Max, Q
from django.utils import timezone

from billing.amounts import round_amount
from fleet.choices import ActualState
from fleet.models import FleetEvent, Instance, UnitPrice

STATE_EVENT = "instance.state"
RUNNING = ActualState.RUNNING.value
US_PER_HOUR = Decimal(3_600_000_000)
GPU_HOURS_EXPONENT = Decimal("1e-6")
# Exact sums of GPU-microseconds x 4-decimal prices need more than the default 28 digits.
_CONTEXT = decimal.Context(prec=60, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class Piece:
    """Part of a running interval with one price in force, within one UTC day."""

    instance_id: int
    model: str
    datacenter: str
    gpu_type: str
    price: UnitPrice | None
    day: date
    start: datetime
    end: datetime
    gpu_us: int  # GPU-microseconds: gpu_count x microseconds

    @property
    def currency(self) -> str:
        return self.price.currency if self.price else ""


@dataclass
class CostLine:
    """A line of one breakdown; ``amount`` is rounded once (see the module docstring)."""

    key: dict
    currency: str  # "" for unpriced time
    gpu_us: int = 0
    numerator: Decimal = field(default_factory=lambda: Decimal(0))  # sum gpu_us x price

    @property
    def gpu_hours(self) -> Decimal:
        return _CONTEXT.divide(Decimal(self.gpu_us), US_PER_HOUR).quantize(
            GPU_HOURS_EXPONENT, rounding=ROUND_HALF_EVEN
        )

    @property
    def amount(self) -> Decimal:
        if not self.currency:
            return Decimal("0.00")
        return round_amount(_CONTEXT.divide(self.numerator, US_PER_HOUR), self.currency)

    def as_dict(self) -> dict:
        return {
            **self.key,
            "currency": self.currency,
            "gpu_hours": self.gpu_hours,
            "amount": self.amount,
        }


@dataclass
class FleetCost:
    start: datetime
    end: datetime
    until: datetime  # min(end, now): time after it is not costed yet
    pieces: list[Piece]

    def breakdown(self, *keys: str) -> list[CostLine]:
        """Lines grouped by the given Piece attributes (and currency), sorted by them."""
        lines: dict[tuple, CostLine] = {}
        for piece in self.pieces:
            values = tuple(getattr(piece, k) for k in keys)
            line = lines.get((values, piece.currency))
            if line is None:
                line = lines[(values, piece.currency)] = CostLine(
                    key=dict(zip(keys, values, strict=True)), currency=piece.currency
                )
            line.gpu_us += piece.gpu_us
            if piece.price is not None:
                line.numerator = _CONTEXT.add(
                    line.numerator,
                    _CONTEXT.multiply(Decimal(piece.gpu_us), piece.price.price_per_gpu_hour),
                )
        return [lines[k] for k in sorted(lines, key=lambda k: (tuple(map(str, k[0])), k[1]))]

    def by_pool(self) -> list[CostLine]:
        return self.breakdown("datacenter", "gpu_type")

    def by_model(self) -> list[CostLine]:
        return self.breakdown("model")

    def by_model_day(self) -> list[CostLine]:
        return self.breakdown("model", "day")

    def by_day(self) -> list[CostLine]:
        return self.breakdown("day")

    @staticmethod
    def totals(lines: list[CostLine]) -> list[dict]:
        """Sum of the rounded amounts per currency; unpriced GPU-hours reported apart."""
        sums: dict[str, Decimal] = defaultdict(lambda: Decimal("0.00"))
        for line in lines:
            if line.currency:
                sums[line.currency] += line.amount
        return [{"currency": c, "amount": sums[c]} for c in sorted(sums)]

    @property
    def gpu_hours(self) -> Decimal:
        total = sum(p.gpu_us for p in self.pieces)
        return CostLine(key={}, currency="", gpu_us=total).gpu_hours

    @property
    def unpriced_gpu_hours(self) -> Decimal:
        total = sum(p.gpu_us for p in self.pieces if p.price is None)
        return CostLine(key={}, currency="", gpu_us=total).gpu_hours


def _micros(delta: timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def running_intervals(
    start: datetime,
    end: datetime,
    *,
    model: str | None = None,
    instances=None,
) -> dict[int, list[tuple[datetime, datetime]]]:
    """Per instance id, its running intervals clipped to [start, end), from the state events.

    Two queries for the events (the last change before `start` per instance, then the
    changes inside the period), however long the history. `instances`: only these.
    """
    instances = Instance.objects.all() if instances is None else instances
    if model is not None:
        instances = instances.filter(served_model__name=model)
    events = FleetEvent.objects.filter(kind=STATE_EVENT, instance__in=instances)
    before = (
        events.filter(created_at__lt=start)
        .values("instance_id")
        .annotate(last=Max("created_at"))
        .values_list("instance_id", "last")
    )
    open_at: dict[int, datetime] = {}
    last_before = dict(before)
    if last_before:
        q = Q()
        for instance_id, when in last_before.items():
            q |= Q(instance_id=instance_id, created_at=when)
        # Ties on created_at: the highest id is the latest change.
        for ev in events.filter(q).order_by("instance_id", "created_at", "id"):
            if ev.instance_id is None:  # never: `events` are those of `instances`
                continue
            if (ev.data or {}).get("new") == RUNNING:
                open_at[ev.instance_id] = start
            else:
                open_at.pop(ev.instance_id, None)
    # Instances never seen changing state (seeded rows) that run now.
    with_events = set(events.values_list("instance_id", flat=True).distinct())
    for inst in instances.filter(actual_state=RUNNING).exclude(pk__in=with_events):
        since = inst.state_changed_at or inst.created_at
        if since < end:
            open_at[inst.pk] = max(since, start)
    intervals: dict[int, list[tuple[datetime, datetime]]] = defaultdict(list)
    inside = events.filter(created_at__gte=start, created_at__lt=end).order_by("created_at", "id")
    for ev in inside.only("instance_id", "created_at", "data"):
        if ev.instance_id is None:  # never: `events` are those of `instances`
            continue
        new = (ev.data or {}).get("new")
        opened = open_at.get(ev.instance_id)
        if new == RUNNING:
            if opened is None:
                open_at[ev.instance_id] = ev.created_at
        elif opened is not None:
            if ev.created_at > opened:
                intervals[ev.instance_id].append((opened, ev.created_at))
            del open_at[ev.instance_id]
    for instance_id, opened in open_at.items():
        if end > opened:
            intervals[instance_id].append((opened, end))
    return dict(intervals)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def keep_runs_of_deleted_instance(sender, instance: Instance, **kwargs) -> None:
    """pre_delete of fleet.Instance: copy its running intervals to DeletedInstanceRun, so
    the fleet's cost of the past does not shrink when an instance is deleted."""
    from billing.models import DeletedInstanceRun

    if instance.pk is None:
        return
    now = timezone.now()
    intervals = running_intervals(
        EPOCH, now, instances=Instance.objects.filter(pk=instance.pk)
    ).get(instance.pk, [])
    if not intervals:
        return
    node = instance.node
    DeletedInstanceRun.objects.bulk_create(
        [
            DeletedInstanceRun(
                instance_id=instance.pk,
                model=instance.served_model.name,
                datacenter=node.datacenter.name,
                datacenter_ref=node.datacenter_id,
                gpu_type=node.gpu_type.model,
                gpu_type_ref=node.gpu_type_id,
                gpu_count=instance.gpu_count,
                started_at=a,
                ended_at=b,
            )
            for a, b in intervals
            if b > a
        ]
    )


def _cut_points(start: datetime, end: datetime, prices: list[UnitPrice]) -> list[datetime]:
    points = {start, end}
    for p in prices:
        for t in (p.effective_from, p.effective_to):
            if t is not None and start < t < end:
                points.add(t)
    day = datetime.combine(start.astimezone(UTC).date(), time(), tzinfo=UTC) + timedelta(days=1)
    while day < end:
        points.add(day)
        day += timedelta(days=1)
    return sorted(points)


def _price_at(prices: list[UnitPrice], when: datetime) -> UnitPrice | None:
    found = None
    for p in prices:
        if (
            p.effective_from <= when
            and (p.effective_to is None or p.effective_to > when)
            and (found is None or p.effective_from > found.effective_from)
        ):
            found = p
    return found


def fleet_cost(
    start: datetime,
    end: datetime,
    *,
    model: str | None = None,
    now: datetime | None = None,
) -> FleetCost:
    """The fleet's cost over [start, end) (up to now), as priced pieces; see the module
    docstring for the rules. `model` limits it to the instances serving that model."""
    if end <= start:
        raise ValueError("end must be later than start.")
    now = now or timezone.now()
    until = max(start, min(end, now))
    pieces: list[Piece] = []
    intervals = running_intervals(start, until, model=model) if until > start else {}
    instances = Instance.objects.select_related(
        "node", "node__datacenter", "node__gpu_type", "served_model"
    ).in_bulk(list(intervals))
    # (instance id, model, datacenter, GPU type, gpu_count, price key, [intervals])
    runs: list[tuple] = []
    for instance_id in sorted(intervals):
        inst = instances.get(instance_id)
        if inst is None:
            continue
        runs.append(
            (
                inst.pk,
                inst.served_model.name,
                inst.node.datacenter.name,
                inst.node.gpu_type.model,
                inst.gpu_count,
                (inst.node.gpu_type_id, inst.node.datacenter_id),
                intervals[instance_id],
            )
        )
    if until > start:
        from billing.models import DeletedInstanceRun

        gone = DeletedInstanceRun.objects.filter(started_at__lt=until, ended_at__gt=start)
        if model is not None:
            gone = gone.filter(model=model)
        for run in gone.order_by("instance_id", "started_at"):
            runs.append(
                (
                    run.instance_id,
                    run.model,
                    run.datacenter,
                    run.gpu_type,
                    run.gpu_count,
                    (run.gpu_type_ref, run.datacenter_ref),
                    [(max(run.started_at, start), min(run.ended_at, until))],
                )
            )
    if not runs:
        return FleetCost(start=start, end=end, until=until, pieces=pieces)
    pairs = {r[5] for r in runs}
    prices: dict[tuple[int, int], list[UnitPrice]] = defaultdict(list)
    pair_q = Q()
    for gpu_type_id, datacenter_id in pairs:
        pair_q |= Q(gpu_type_id=gpu_type_id, datacenter_id=datacenter_id)
    in_period = UnitPrice.objects.filter(pair_q, effective_from__lt=until).filter(
        Q(effective_to__isnull=True) | Q(effective_to__gt=start)
    )
    for p in in_period:
        prices[(p.gpu_type_id, p.datacenter_id)].append(p)
    for instance_id, model_name, datacenter, gpu_type, gpu_count, pair, spans in runs:
        own = prices.get(pair, [])
        for a, b in spans:
            if b <= a:
                continue
            cuts = _cut_points(a, b, own)
            for lo, hi in zip(cuts, cuts[1:], strict=False):
                pieces.append(
                    Piece(
                        instance_id=instance_id,
                        model=model_name,
                        datacenter=datacenter,
                        gpu_type=gpu_type,
                        price=_price_at(own, lo),
                        day=lo.astimezone(UTC).date(),
                        start=lo,
                        end=hi,
                        gpu_us=gpu_count * _micros(hi - lo),
                    )
                )
    return FleetCost(start=start, end=end, until=until, pieces=pieces)
