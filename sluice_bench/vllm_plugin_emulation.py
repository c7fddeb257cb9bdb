"""The plug-in's decisions inside the simulator: what `vllm serve --scheduler-cls` with a
Sluice policy does, step by step, for the simulator to predict its runs.

    with emulating(): Simulation(SimConfig(policy="vllm_plugin:plugin=NAME[,plugin_KEY=VALUE...]"), ...)
        vLLM V1's loop as Sluice's `vllm_chunked` models it (running requests first under the
        token budget, preempting the last of the running list when KV runs short; then waiting
        ones admitted in order, with chunked prefill and per-chunk KV, until one does not fit),
        with the plug-in policy NAME (sluice_vllm/policies.py, its options KEY=VALUE) deciding
        what the plug-in decides inside vLLM, through the same calls in the same order as
        sluice_vllm/scheduler.py makes them: each step `before_step` over the waiting jobs, the
        waiting queue sorted by `Job.rank`, the running list sorted by its running order (so the
        last is the victim), the token budget and the admission cap; after each step
        `on_step_time` and, every `refresh_every()` steps, `on_step` with the jobs served.

Why not Sluice's own policy of the same name: the plug-in can only reorder vLLM's lists and set
its budget and cap (the table in docs/results/vllm_plugin.md), so Sluice's ALISE, which pauses
running jobs for shorter waiting ones, or its FastServe, which demotes by its own quanta, decide
differently from the plug-in in vLLM's loop. A step's seconds here are the simulated step's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from scheduler_service.core.policy import POLICIES, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.baselines.vllm_chunked import ChunkedConfig, ChunkedPrefillPolicy
from scheduler_service.policies.decisions import is_offline_slo
from sluice.common.config import config_from_options
from sluice.contract.plan import StepPlan, StepResult
from sluice_vllm.hints import Hints
from sluice_vllm.policies import RANK, Job, Limits, PluginPolicy, build_policy

PLUGIN_OPTION = "plugin_"  # vllm_plugin:plugin=sarathi,plugin_budget=128: the plug-in's budget=128
RUNNING = (RequestStatus.PREFILLING, RequestStatus.DECODING)


@dataclass
class PluginEmulationConfig(ChunkedConfig):
    plugin: str = "fcfs"  # the plug-in policy (SLUICE_VLLM_POLICY's name)
    plugin_options: dict[str, str] = field(default_factory=dict)  # its options, from plugin_KEY=VALUE
    allocate_whole_prompt: bool = False  # vLLM V1 allocates KV per chunk

    @classmethod
    def from_options(cls, options: dict[str, str]) -> PluginEmulationConfig:
        own = {k: v for k, v in options.items() if not k.startswith(PLUGIN_OPTION)}
        config = config_from_options(cls, own, cls.__name__)
        config.plugin_options = {
            k.removeprefix(PLUGIN_OPTION): v for k, v in options.items() if k.startswith(PLUGIN_OPTION)
        }
        return config


def hints_of(request: Request) -> Hints:
    """What the request's `vllm_xargs` tell the plug-in: its predicted length and SLOs."""
    slo = request.slo
    return Hints(
        predicted_tokens=request.predicted_output_tokens,
        ttft_s=slo.ttft_s,
        tbt_s=slo.tbt_s,
        jct_s=slo.jct_s,
        offline=is_offline_slo(slo.ttft_s, slo.tbt_s, slo.jct_s),
    )


class PluginEmulation(ChunkedPrefillPolicy):
    name = "vllm_plugin"
    config_cls = PluginEmulationConfig
    config: PluginEmulationConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self.plugin: PluginPolicy = build_policy(
            self.config.plugin, self.config.plugin_options, Limits(ctx.max_num_seqs, ctx.max_num_batched_tokens)
        )
        p = self.plugin
        self.budget = min(p.fixed_budget or ctx.max_num_batched_tokens, ctx.max_num_batched_tokens)
        self.jobs: dict[str, Job] = {}
        self.cap = ctx.max_num_seqs
        self.every = p.refresh_every()
        self._pending: set[str] = set()
        self._pending_s = 0.0
        self._pending_steps = 0
        self._served: list[str] = []
        self._ranked: list[Job] = []  # this step's waiting jobs in the plug-in's order
        self._started = 0.0
        kind = type(p)
        self._budgets = kind.token_budget is not PluginPolicy.token_budget
        self._caps = kind.admission_cap is not PluginPolicy.admission_cap

    # ------------------------------------------------ requests

    def on_arrival(self, request: Request, now: float) -> None:
        job = Job(request, hints_of(request), now)
        self.jobs[request.request_id] = job
        self.plugin.on_add(job, now)

    def on_finished(self, request: Request, now: float) -> None:
        self.jobs.pop(request.request_id, None)

    # ------------------------------------------------ one step (the plug-in's _sluice_before, then vLLM's loop)

    def schedule(self, step: StepBuilder, now: float) -> None:
        p, jobs = self.plugin, self.jobs
        self._started = now
        # the waiting queue as the plug-in leaves it for vLLM: aged, then sorted by rank (once a step)
        waiting = [jobs[rid] for rid in step.waiting] if p.reorders_waiting or p.budget_reads_jobs else []
        if p.reorders_waiting and waiting:
            p.before_step(waiting, (), now)
            waiting.sort(key=RANK)
        self._ranked = waiting
        if self._budgets:
            running = [jobs[rid] for rid in step.running] if p.budget_reads_jobs else []
            budget = p.token_budget(running, waiting if p.budget_reads_jobs else [], now)
            most = self.ctx.max_num_batched_tokens
            step.budget.max_tokens = most if budget is None else min(budget, most)
        if self._caps:
            cap = p.admission_cap()
            self.cap = self.ctx.max_num_seqs if cap is None else min(cap, self.ctx.max_num_seqs)
        super().schedule(step, now)
        self._served = list(step.scheduled)

    def token_budget(self, now: float) -> int:
        return self.budget

    def seat_limit(self) -> int:
        return self.cap

    def running_queue(self, step: StepBuilder) -> deque[Request]:
        """vLLM's running list: admission order, or sorted by the plug-in's running order."""
        requests = list(step.running.values())
        key = self.plugin.running_order
        if key is not None and len(requests) > 1:
            jobs = self.jobs
            requests.sort(key=lambda r: getattr(jobs[r.request_id], key), reverse=self.plugin.running_descending)
        return deque(requests)

    def admission_order(self, step: StepBuilder) -> Iterator[Request]:
        if step.num_preempted:
            return iter(())  # vLLM V1 admits no waiting request in a step that preempted one
        if not self.plugin.reorders_waiting:
            return super().admission_order(step)  # vLLM's FCFS deque
        # NOTE: nothing was preempted, so the waiting queue is still the one sorted before the step
        return iter([j.req for j in self._ranked])  # type: ignore[misc]

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        p = self.plugin
        step_s = now - self._started
        p.on_step_time(step_s)
        self._pending.update(self._served)
        self._pending_s += step_s
        self._pending_steps += 1
        if self._pending_steps >= self.every:
            served = [self.jobs[rid] for rid in self._pending if rid in self.jobs]
            if served:
                p.on_step(served, self._pending_s, now)
            self._pending.clear()
            self._pending_s = 0.0
            self._pending_steps = 0

    def stats_report(self) -> dict[str, Any]:
        return {"plugin": self.plugin.name}


def emulating() -> AbstractContextManager[type[PluginEmulation]]:
    """`vllm_plugin` is a simulator policy while the block runs (build and run the simulation
    inside it); it is the benchmark's, so `sluice simulate` and the policy lists never show it."""
    return POLICIES.registered(PluginEmulation.name, PluginEmulation)
