"""Sluice's scheduling policies inside vLLM: a scheduler class for `vllm serve --scheduler-cls`.

    sluice_vllm.config      the configuration (environment variables), no vLLM
    sluice_vllm.hints       per-request hints from `extra_args` / `vllm_xargs`, no vLLM
    sluice_vllm.policies    what each policy decides, Sluice's pure rules, no vLLM
    sluice_vllm.predictor   Sluice's length predictor off the engine loop, no vLLM
    sluice_vllm.vllm_compat the vLLM internals relied on, checked at start (imports vLLM)
    sluice_vllm.scheduler   SluiceScheduler / SluiceAsyncScheduler (imports vLLM)
    sluice_vllm.launcher    `vllm serve` for the CPU build (its distribution name), no vLLM at import

Importing this package imports no vLLM: the project runs without it.
"""
