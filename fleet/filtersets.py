"""Query filters for the fleet API collections."""

from __future__ import annotations

import django_filters

from base.filters import BoundedFilterSet, IdFilter
from fleet.models import (
    Datacenter,
    FleetEvent,
    GPUType,
    Instance,
    Node,
    ServedModel,
    UnitPrice,
    WANLink,
)


class DatacenterFilterSet(BoundedFilterSet):
    class Meta:
        model = Datacenter
        fields = {
            "name": ["exact", "icontains"],
            "region": ["exact", "icontains"],
            "rdma_domain": ["exact"],
        }


class GPUTypeFilterSet(BoundedFilterSet):
    class Meta:
        model = GPUType
        fields = {
            "vendor": ["exact", "icontains"],
            "model": ["exact", "icontains"],
            "memory_gib": ["gte", "lte"],
            "peak_bf16_tflops": ["gte", "lte"],
            "memory_bandwidth_gbps": ["gte", "lte"],
        }


class UnitPriceFilterSet(BoundedFilterSet):
    effective_at = django_filters.IsoDateTimeFilter(
        method="filter_effective_at",
        label="Prices in force at this time (ISO 8601)",
    )

    class Meta:
        model = UnitPrice
        fields = {"gpu_type": ["exact"], "datacenter": ["exact"], "currency": ["exact"]}

    def filter_effective_at(self, queryset, name, value):
        return queryset.effective_at(value)


class WANLinkFilterSet(BoundedFilterSet):
    class Meta:
        model = WANLink
        fields = {
            "from_datacenter": ["exact"],
            "to_datacenter": ["exact"],
            "status": ["exact"],
            "bandwidth_gbps": ["gte", "lte"],
        }


class ServedModelFilterSet(BoundedFilterSet):
    class Meta:
        model = ServedModel
        fields = {"name": ["exact", "icontains"], "dtype": ["exact"]}


class NodeFilterSet(BoundedFilterSet):
    class Meta:
        model = Node
        fields = {
            "datacenter": ["exact"],
            "gpu_type": ["exact"],
            "status": ["exact"],
            "hostname": ["exact", "icontains"],
        }


class InstanceFilterSet(BoundedFilterSet):
    datacenter = IdFilter(field_name="node__datacenter", label="Datacenter id")

    class Meta:
        model = Instance
        fields = {
            "role": ["exact"],
            "node": ["exact"],
            "served_model": ["exact"],
            "desired_state": ["exact"],
            "actual_state": ["exact"],
        }


class FleetEventFilterSet(BoundedFilterSet):
    class Meta:
        model = FleetEvent
        fields = {"node": ["exact"], "instance": ["exact"], "kind": ["exact", "startswith"]}
