"""ALISE: speculative (predicted-SRTF) scheduling with priority queues, aging and EWT swapping,
on the MLFQ machinery it shares with FastServe (`policies/mlfq.py`)."""

from scheduler_service.policies.alise import policy  # noqa: F401  (registration)
