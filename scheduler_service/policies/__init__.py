"""Scheduling policies, one module each, registered by name in `POLICIES`.

Importing this package registers every built-in policy (and the routers that come with them)."""

from scheduler_service import routers_extra  # noqa: F401  (SCLS policy and routers: scls, max_min, kv_aware)
from scheduler_service.policies import (  # noqa: F401  (registration)
    accelgen,
    alise,
    chunked,
    econoserve,
    fastserve,
    orca,
    sls,
    vllm,
)
