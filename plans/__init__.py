"""Capacity-plan runs over the fleet in the database: the planner's inputs built from fleet rows,
plan runs (``PlanRun``), their service, Celery task, REST API and ``manage.py plan``.

It sits above ``fleet`` (whose rows it reads) and ``planner`` (which it runs)."""
