"""What one step's answer produced: the new tokens and the requests that ended. Its own module
so that the scheduler and the overlap bookkeeping (core/overlap.py) both import it downwards."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.request import Request


@dataclass(slots=True)
class StepOutputs:
    tokens: list[tuple[Request, int]] = field(default_factory=list)  # (request, new token id)
    finished: list[Request] = field(default_factory=list)
