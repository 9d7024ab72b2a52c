"""One request's state along the gateway's path (routing/gateway/README.md): what admission
found (`admission.py`), what routing decided (`routes.py`), and what the run has changed since
(retries, migrations)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from billing.models import ApiKey
from fleet.models import ServedModel
from pdd.policy import Decision, PolicySettings, RequestInfo
from routing.gateway.errors import GatewayError
from routing.gateway.parsing import GatewayRequest
from routing.gateway.timing import Stopwatch


@dataclass(eq=False)
class Prepared:
    """Who asks (key), what (the parsed request, its token ids), where it runs (the decision and
    the plan for P) and why (the policy's inputs), for the current attempt."""

    # Admission
    key: ApiKey
    greq: GatewayRequest
    model: ServedModel
    tokenizer: Any
    prompt_ids: list[int]
    request_id: str
    kind: str  # "chat.completions" or "completions"
    client_request_id: str = ""
    received_at: float = 0.0
    watch: Stopwatch | None = None
    # Routing (routes.route sets these; a retry or a migration sets them again)
    info: RequestInfo | None = None
    policy: PolicySettings | None = None
    version: int = 0
    first_token_early: bool = False
    decision: Decision | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    url: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    prefill_http: str = ""
    # Attempts: retries before the first token, migrations after it
    attempt: int = 0
    migrations: int = 0
    retried: list[dict[str, Any]] = field(default_factory=list)
    continue_ids: list[int] | None = None  # a migration: the prompt plus the delivered tokens
    continue_max_tokens: int | None = None
    # Overload: when an engine first had no room for this request, and how often since.
    busy_since: float | None = None
    busy_tries: int = 0


class Refused(Exception):
    """A request refused after admission read it and before any agent was called (the tenant's
    rate limit, no healthy path): the answer (``error``) and why, for the ``rejected`` record
    the composer has written before it answers (views.py, ``recorder.rejected``)."""

    def __init__(
        self, p: Prepared, error: GatewayError, reason: str, *, late: bool = False
    ) -> None:
        super().__init__(reason)
        self.p, self.error, self.reason = p, error, reason
        # No path only because some instances' reports are late (LiveView.late): the
        # composer waits in the overload queue and routes the request again.
        self.late = late
