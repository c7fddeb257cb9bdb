"""AccelGen: SLO-derived dynamic chunking, remaining-time ordering and multi-resource batching.

    policy.py   the policy (budget, ERA, Algorithms 1 and 2)
    queue.py    T_r ordering with JCT carry-forward
    select.py   Algorithm 2's Euclidean pick
    kv.py       per-chunk KV demand
"""

from scheduler_service.policies.accelgen import policy  # noqa: F401  (registration)
