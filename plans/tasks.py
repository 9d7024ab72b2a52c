"""The Celery task that runs a queued capacity plan."""

from __future__ import annotations

from celery import shared_task

from plans import autopilot, services, sizing

# A plan simulates every combination of counts (up to 64), each a goodput bisection: minutes,
# not the seconds the default limits allow. The soft limit fails the run with its reason.
PLAN_SOFT_TIME_LIMIT_S = 30 * 60
PLAN_TIME_LIMIT_S = PLAN_SOFT_TIME_LIMIT_S + 60


@shared_task(
    name=services.PLAN_EXECUTE,
    soft_time_limit=PLAN_SOFT_TIME_LIMIT_S,
    time_limit=PLAN_TIME_LIMIT_S,
)
def plan_execute(plan_run_id: int) -> str:
    """Run one queued capacity plan; a run that is not queued (already started) is left alone."""
    run = services.plan_run_execute(plan_run_id=plan_run_id)
    return run.status if run is not None else "missing"


@shared_task(
    name=sizing.SIZE_EXECUTE,
    soft_time_limit=PLAN_SOFT_TIME_LIMIT_S,
    time_limit=PLAN_TIME_LIMIT_S,
)
def sizing_execute(sizing_run_id: int) -> str:
    """Run one queued sizing run (``planner size``); one not queued is left alone."""
    run = sizing.sizing_run_execute(sizing_run_id=sizing_run_id)
    return run.status if run is not None else "missing"


@shared_task(
    name=autopilot.PROPOSE,
    soft_time_limit=PLAN_SOFT_TIME_LIMIT_S,
    time_limit=PLAN_TIME_LIMIT_S,
)
def autopilot_propose(proposal_id: int) -> str:
    """Size one autopilot proposal (one not being sized is left alone)."""
    proposal = autopilot.proposal_execute(proposal_id=proposal_id)
    return proposal.status if proposal is not None else "missing"


@shared_task(name=autopilot.APPLY)
def autopilot_apply(proposal_id: int) -> str:
    """Carry an approved proposal as far as it goes now (the tick carries it on)."""
    proposal = autopilot.proposal_apply(proposal_id=proposal_id)
    return proposal.status if proposal is not None else "missing"


@shared_task(name="plans.autopilot_tick")
def autopilot_tick() -> dict:
    """The autopilot's schedule: apply, record realised figures, propose, auto-approve."""
    return autopilot.autopilot_tick()
