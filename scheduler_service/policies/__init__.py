"""Scheduling policies, one package per paper plus the baselines, registered by name in `POLICIES`.

    baselines/   vllm, vllm_chunked, orca, sls, fastserve
    sarathi/     Sarathi-Serve          accelgen/   AccelGen         econoserve/  EconoServe
    scls/        SCLS (with its routers max_min and scls)           alise/       ALISE
    common.py    continuous-batching helpers the baselines share (FCFS admission, victims)
    mlfq.py      the multi-level queue machinery of ALISE and FastServe

Importing this package registers every built-in policy and SCLS's routers."""

from scheduler_service.policies import accelgen, alise, baselines, econoserve, sarathi, scls  # noqa: F401  (registration)
