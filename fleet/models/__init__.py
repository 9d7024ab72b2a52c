"""Fleet models, split by sub-domain."""

from fleet.models.datacenters import Datacenter
from fleet.models.events import FleetEvent
from fleet.models.gpus import GPUType
from fleet.models.links import WANLink
from fleet.models.nodes import Instance, Node
from fleet.models.pricing import UnitPrice
from fleet.models.served_models import ServedModel

__all__ = [
    "Datacenter",
    "FleetEvent",
    "GPUType",
    "Instance",
    "Node",
    "ServedModel",
    "UnitPrice",
    "WANLink",
]
