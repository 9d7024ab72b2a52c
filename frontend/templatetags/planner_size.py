"""``{% sizing_section %}``: the planner page's sizing section (frontend/planner_size.py)."""

from __future__ import annotations

from typing import Any

from django import template

from frontend.planner_size import sizing_context

register = template.Library()


@register.inclusion_tag("frontend/planner_size.html", takes_context=True)
def sizing_section(context: template.Context) -> dict[str, Any]:
    # Django passes csrf_token on to an inclusion tag's template by itself.
    ctx = sizing_context(context.get("request"), bool(context.get("is_operator")))
    ctx["messages"] = context.get("messages")
    return ctx
