"""`vllm`: vLLM's original scheduler, FCFS and prefill-prioritizing.

Why choose it: the baseline every paper compares against (Sarathi-Serve Algorithm 2).
What it does: each iteration, if no request is swapped out, admit waiting requests FCFS
while their whole prompt gets blocks (keeping a 1% watermark free) within
`max_num_seqs` and `max_num_batched_tokens`, and run a prefill-only iteration; otherwise
run one decode iteration over every running request. A running request that needs a
block when none is free preempts the newest running request (recompute, or swap), which
goes to the head of the queue. Swapped requests come back FCFS when blocks allow.
Inputs: none beyond the queue. Allocation: block by block.
"""

from __future__ import annotations

from collections import deque

from scheduler_service.core.policy import POLICIES, Policy
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.common import (
    ContinuousBatchingConfig,
    admission_fits,
    never_fits,
    preempt_for_priority,
    preemption_mode,
    reject_unservable,
    schedule_with_preemption,
    swap_in_fcfs,
    victim_order,
    waiting_order,
)


@POLICIES.register("vllm")
class VLLMPolicy(Policy):
    name = "vllm"
    overlap_safe = True  # no state between schedule and on_step_result
    config_cls = ContinuousBatchingConfig
    config: ContinuousBatchingConfig

    def schedule(self, step: StepBuilder, now: float) -> None:
        if step.waiting and not step.swapped and self._admit_prefills(step):
            step.metadata["phase"] = "prefill"
            return
        self._decode_all(step)
        if step.swapped and not step.num_preempted:  # NOTE: most steps swap nothing in: no call
            swap_in_fcfs(step, self.ctx.max_num_seqs)

    def _admit_prefills(self, step: StepBuilder) -> int:
        admitted = 0
        mode = preemption_mode(self.config)
        for req in waiting_order(step, self.config.priority):
            n = req.num_tokens_to_compute
            if n > step.budget.max_tokens:
                reject_unservable(step, req, f"prompt_too_long: {n} tokens exceed max_num_batched_tokens")
                continue
            if never_fits(step, req, self.config.watermark):
                reject_unservable(step, req, "unschedulable: the prompt needs more KV than the worker has")
                continue
            if len(step.running) >= self.ctx.max_num_seqs or not step.budget.can_fit(n):
                break
            fits = admission_fits(step, req, req.num_tokens, self.config.watermark)
            if not fits and self.config.priority and not step.running.keys() & step.scheduled.keys():
                fits = preempt_for_priority(step, req, req.num_tokens, mode)
            if not fits or not step.schedule(req, n):
                break
            admitted += 1
        return admitted

    def _decode_all(self, step: StepBuilder) -> None:
        mode = preemption_mode(self.config)
        # NOTE: one deque serves as both the work list (from the left) and the victim list
        # (from the right), as in vLLM: victims are always the newest unprocessed requests.
        queue = deque(victim_order(list(step.running.values()), self.config.priority))
        while (req := step.schedule_covered(queue)) is not None:
            n = req.num_tokens_to_compute
            if not schedule_with_preemption(step, req, n, queue, mode) and not step.budget.can_fit(n):
                break
