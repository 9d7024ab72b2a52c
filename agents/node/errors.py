"""The error every agent component raises for the HTTP layer to answer with a status code."""

from __future__ import annotations


class AgentError(Exception):
    """An error the HTTP layer turns into a status code and a JSON message."""

    def __init__(
        self, status: int, message: str, field: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.code = code  # machine-readable, e.g. pdd.events.ENGINE_FULL
