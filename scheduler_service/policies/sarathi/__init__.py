"""Sarathi-Serve (OSDI'24): stall-free batching with an SLO-derived token budget."""

from scheduler_service.policies.sarathi import policy  # noqa: F401  (registration)
