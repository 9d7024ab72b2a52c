"""Routing: the live request path (gateway, request records and decision log).

The gateway decides with the pure routing policy, ``pdd.policy``, which the planner's
simulator calls too.
"""
