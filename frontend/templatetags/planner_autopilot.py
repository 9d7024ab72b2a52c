"""``{% autopilot_section %}``: the planner page's autopilot section
(frontend/planner_autopilot.py)."""

from __future__ import annotations

from typing import Any

from django import template

from frontend.planner_autopilot import autopilot_context

register = template.Library()


@register.inclusion_tag("frontend/planner_autopilot.html", takes_context=True)
def autopilot_section(context: template.Context) -> dict[str, Any]:
    # Django passes csrf_token on to an inclusion tag's template by itself.
    ctx = autopilot_context(bool(context.get("is_operator")))
    ctx["messages"] = context.get("messages")
    return ctx
