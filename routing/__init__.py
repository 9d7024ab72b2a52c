"""Routing: the live request path (policy, gateway, request records and decision log).

Kept free of Django imports so the planner's simulator can import ``routing.policy``.
"""
