"""Scheduling policies, one module each, registered by name in `POLICIES`.

Importing this package registers every built-in policy."""

from scheduler_service.policies import chunked, orca, sls, vllm  # noqa: F401  (registration)
