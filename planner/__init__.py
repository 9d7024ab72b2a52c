"""Baton's planner: a discrete-event simulator of PDD fleets and a capacity planner on top.

Pure Python + numpy (matplotlib only for plots); never Django. Public API: ``simulate`` and
``plan`` in ``planner.api``; the workload model in ``planner.workload``.
"""
