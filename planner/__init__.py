"""Baton's planner: a discrete-event simulator of PDD fleets and a capacity planner on top.

Pure Python + numpy (matplotlib only for plots); never Django. Public API: ``simulate`` and
``plan`` in ``planner.api``; the workload model in ``planner.workload``.
"""

from planner import native as _native

# The compiled simulator (planner/native.py), only where its build matches these sources.
_native.enable(__path__)
