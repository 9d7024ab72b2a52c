"""Baton's planner: a discrete-event simulator of PDD fleets and a capacity planner on top.

Python + numpy (matplotlib only for plots); never Django. Public API: ``simulate`` and
``plan`` in ``planner.api``; the workload model in ``planner.workload``. The simulator's hot
modules also run compiled where ``make setup`` built them (``planner/native.py``).
"""

from planner import native as _native

# The compiled simulator (planner/native.py), only where its build matches these sources.
_native.enable(__path__)
