"""Sizing runs: ``planner size`` as a long job (create, execute) for the REST API, the Celery
task and the /planner/ page.

A run asks for the cheapest fleet that meets an SLA at a target rate, and the best-BCR fleet
(``planner.size.size``). The starting fleet is the scenario's pools or, with ``from_db``, the
fleet in the database (``plans.services.planner_fleet_from_db``), built when the run is created
so a queued run keeps the fleet it was asked about and missing fleet data fails at once.
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

from plans.models import SizingRun
from plans.services import (
    PlanInputError,
    enqueue_run,
    execute_run,
    finite_json,
    planner_fleet_from_db,
    scenario_config,
)

DEFAULT_SIZE_SCENARIO = "tiny-size"
SIZE_EXECUTE = "plans.sizing_execute"
MAX_RPS = 1_000.0
MAX_SLA_S = 3_600.0
# The most units of one pool a run searches (the CLI's limit is planner.size.MAX_COUNT): the
# upper-bound doubling stops there with "not met", so a hopeless question ends sooner.
SIZE_MAX_COUNT = 1024
# One process: a Celery prefork worker is a daemon and may not start a process pool, and on
# the embedded defaults the run shares the web process. tiny-size takes a few seconds on one.
SIZE_WORKERS = 1
# Progress is written at most this often (each probe of tiny-size takes ~0.1 s).
PROGRESS_EVERY_S = 0.5


def _number(field: str, value: Any, hi: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanInputError(field, f"must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and 0 < value <= hi):
        raise PlanInputError(field, f"must be a number > 0 and <= {hi:g}, got {value:g}")
    return value


def sizing_inputs(
    *,
    scenario: str = DEFAULT_SIZE_SCENARIO,
    rps: float | None = None,
    p90: float | None = None,
    p99: float | None = None,
    from_db: bool = False,
) -> dict[str, Any]:
    """The checked arguments of one sizing run, JSON-ready. Raises PlanInputError (a
    ValueError) naming the field, or ``fleet`` for missing fleet data when ``from_db``."""
    scenario_config(scenario)  # a bundled fleet scenario, or PlanInputError("scenario")
    rps = _number("rps", rps, MAX_RPS)
    sla = {}
    for field, key, value in (("p90", "ttft_p90_s", p90), ("p99", "ttft_p99_s", p99)):
        checked = _number(field, value, MAX_SLA_S)
        if checked is not None:
            sla[key] = checked
    notes = []
    fleet = None
    if from_db:
        fleet = planner_fleet_from_db(scenario)
        notes.append(
            "starting fleet from the database (counts = nodes now running each role); "
            + fleet.get("_source", "")
        )
    else:
        notes.append(f"starting fleet: the pools of scenario {scenario!r}")
    return {
        "scenario": scenario,
        "rps": rps,
        "sla": sla,
        "from_db": bool(from_db),
        "fleet": finite_json(fleet),
        "workers": SIZE_WORKERS,
        "notes": notes,
    }


def sizing_run_create(
    *,
    scenario: str = DEFAULT_SIZE_SCENARIO,
    rps: float | None = None,
    p90: float | None = None,
    p99: float | None = None,
    from_db: bool = False,
    created_by=None,
) -> SizingRun:
    """Record a queued sizing run; a worker runs it after commit (in-process on the embedded
    defaults). Bad input raises PlanInputError before anything is recorded."""
    inputs = sizing_inputs(scenario=scenario, rps=rps, p90=p90, p99=p99, from_db=from_db)
    run = SizingRun.objects.create(
        scenario=scenario,
        rps=inputs["rps"],
        p90=inputs["sla"].get("ttft_p90_s"),
        p99=inputs["sla"].get("ttft_p99_s"),
        start_from_db=inputs["from_db"],
        inputs=inputs,
        created_by=created_by if getattr(created_by, "is_authenticated", False) else None,
    )
    enqueue_run(SIZE_EXECUTE, SizingRun, run.pk, "the sizing run")
    return run


def _db_progress(run_id: int):
    """A planner.size Progress that saves its counts and note on the run's row."""
    from planner.size import Progress

    class RowProgress(Progress):
        def __init__(self) -> None:
            super().__init__(stream=io.StringIO(), enabled=False)
            self._saved = 0.0

        def _draw(self) -> None:
            now = time.perf_counter()
            if now - self._saved < PROGRESS_EVERY_S and self.done not in (0, self.total):
                return
            self._saved = now
            self.save()

        def save(self) -> None:
            SizingRun.objects.filter(pk=run_id).update(
                progress_done=min(self.done, self.total),
                progress_total=self.total,
                progress_note=self.note[:200],
            )

    return RowProgress()


def sizing_run_execute(*, sizing_run_id: int) -> SizingRun | None:
    """Run a queued sizing run to done or failed (plans.services.execute_run)."""
    from planner.size import size

    def work(run: SizingRun) -> dict[str, Any]:
        inputs = run.inputs
        progress = _db_progress(sizing_run_id)
        result = size(
            inputs["scenario"],
            inputs.get("rps"),
            fleet=inputs.get("fleet"),
            sla=inputs.get("sla") or None,
            workers=inputs.get("workers", SIZE_WORKERS),
            max_count=SIZE_MAX_COUNT,
            progress=progress,
        )
        progress.note = "done"
        progress.save()
        return {"result": finite_json(result)}

    return execute_run(SizingRun, sizing_run_id, "sizing run", work)
