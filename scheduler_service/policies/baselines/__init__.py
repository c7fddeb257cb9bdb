"""The baselines the papers compare against: `vllm` (continuous batching, prefill-first),
`vllm_chunked` (chunked prefill under a fixed budget), `fastgen` (chunked, with a cap on the
sequences in flight: SCLS's ILS baseline), `orca` (iteration-level scheduling
with whole prompts), `sls` (static batching) and `fastserve` (skip-join MLFQ)."""

from scheduler_service.policies.baselines import fastgen, fastserve, orca, sls, vllm, vllm_chunked  # noqa: F401  (registration)
