"""The baselines the papers compare against: `vllm` (continuous batching, prefill-first),
`vllm_chunked` (chunked prefill under a fixed budget), `orca` (iteration-level scheduling
with whole prompts), `sls` (static batching) and `fastserve` (skip-join MLFQ)."""

from scheduler_service.policies.baselines import fastserve, orca, sls, vllm, vllm_chunked  # noqa: F401  (registration)
