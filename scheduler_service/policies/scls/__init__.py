"""SCLS: slice-level scheduling, a replica policy plus a global batcher and offloader.

    policy.py     the worker side: runs slices of a batch together, returns them to the pool
    router.py     the `scls` router (DP batcher, max-min offloader, adaptive interval) and `max_min`
    batcher.py    Algorithm 1 (the DP batcher) and the max-min offloader
    estimator.py  serving-time and memory estimators
"""

from scheduler_service.policies.scls import policy, router  # noqa: F401  (registration)
