"""Print the fleet in the database as a planner fleet (JSON): what `planner size --from-db` sizes.

The planner knows nothing of Django: ``python -m planner size --from-db`` runs this command
(``manage.py planner_fleet SCENARIO``) and reads its output. The fleet is
``plans.services.planner_fleet_from_db``: GPU types, unit prices in force and the WAN link
from the inventory, model and engine from the scenario, the pools' counts the nodes now
running each role.
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from plans.services import planner_fleet_from_db


class Command(BaseCommand):
    help = (
        "The fleet in the database as a planner fleet, as JSON on stdout (GPU types, unit "
        "prices and the WAN link from the inventory; model and engine from the scenario; "
        "counts = the nodes now running each role). `python -m planner size --from-db` "
        "starts from it."
    )

    def add_arguments(self, parser):
        parser.add_argument("scenario", help="planner scenario (name or path)")

    def handle(self, *args, **opts):
        try:
            fleet = planner_fleet_from_db(opts["scenario"])
        except (ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(fleet))
