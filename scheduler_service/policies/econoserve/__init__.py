"""EconoServe: PT/GT decoupling with exact allocation, time-synced groups and KV pipelining.

    policy.py   the policy and its variants (D, SD, SDO, full)
    queues.py   the PT and GT queues and their ordering
    pipe.py     KVCPipe: lending a finishing request's KV tail to a newcomer
"""

from scheduler_service.policies.econoserve import policy  # noqa: F401  (registration)
