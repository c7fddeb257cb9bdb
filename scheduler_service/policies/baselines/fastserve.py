"""`fastserve`: skip-join multi-level feedback queue with KV swapping (FastServe, Wu et al.
2023, section 4; the MLFQ reference AccelGen compares against).

Why choose it: preemptive and length-agnostic. It needs no output-length prediction, yet
short jobs overtake long ones, because a job's priority falls as it consumes service.

What it does: `num_queues` queues (5) with quanta doubling per level (`quantum_s * 2^i`).
A new job skips the queues whose quantum is shorter than its prefill time (cost model
`prefill_time`) and joins the first whose quantum covers it (skip-join). Each iteration
runs the highest-priority jobs (queue, then order of entering it) that fit the seats, the
token budget and the KV; the others pause with their KV kept on the GPU. A job whose
service in its queue (the summed duration of the iterations it ran in) reaches the
queue's quantum is demoted to the next queue's tail. When GPU KV is short, the lowest-ranked
holders are swapped out to CPU (`memory=swap`; `recompute` and `defer` also work).

Inputs: the cost model (skip-join and the default quantum); no lengths.
Configuration: see `FastServeConfig`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES, PolicyContext
from scheduler_service.core.request import Request
from scheduler_service.policies.decisions import mlfq_quanta, quantum_spent, skip_join_level
from scheduler_service.policies.mlfq import JobState, QueuePolicy, QueuePolicyConfig, Rank
from sluice.contract.plan import StepPlan, StepResult

# NOTE: without a cost model (unit tests) a prompt token is priced at this many seconds.
DEFAULT_PREFILL_S_PER_TOKEN = 2e-4
DEFAULT_QUANTUM_S = 0.02


@dataclass
class FastServeConfig(QueuePolicyConfig):
    num_queues: int = 5  # MLFQ levels
    quantum_s: float | None = None  # quantum of queue 0; None: one batch-1 decode step at context 512


@POLICIES.register("fastserve")
class FastServePolicy(QueuePolicy):
    name = "fastserve"
    config_cls = FastServeConfig
    config: FastServeConfig
    # NOTE: a step's service is its measured time, known from its answer: planned ahead, a job
    # whose quantum step N used up is demoted from plan N+2 on (it runs N+1 in its old queue).
    overlap_safe = True
    # NOTE: a paused job's rank never moves (demotion happens to jobs that ran), and thousands
    # of jobs sit paused: sorting them every step was a fifth of `schedule()`.
    index_paused = True
    # NOTE: its ranks move only at arrival and demotion, where `JobState.entry` is built too
    entries_current = True

    def __init__(self, config: FastServeConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx, num_levels=config.num_queues)
        if config.quantum_s is not None:
            base = config.quantum_s
        elif ctx.cost_model is not None:
            base = ctx.cost_model.decode_time(1, 512)
        else:
            base = DEFAULT_QUANTUM_S
        self.quanta = mlfq_quanta(base, config.num_queues)

    def prefill_time(self, num_tokens: int) -> float:
        cm = self.ctx.cost_model
        return cm.prefill_time(num_tokens) if cm is not None else num_tokens * DEFAULT_PREFILL_S_PER_TOKEN

    def join_level(self, request: Request) -> int:
        """Skip-join: the first queue whose quantum covers the job's prefill time."""
        return skip_join_level(self.quanta, self.prefill_time(request.num_prompt_tokens))

    def rank(self, req: Request) -> Rank:
        st: JobState = req.policy_state
        return (st.level, st.key, st.seq)

    def refresh_ranks(self, jobs: Iterable[Request]) -> None:
        """Nothing to do: `JobState.rank` is set wherever the level or key moves (arrival,
        demotion), so it is always current (a step does not re-rank its running jobs)."""

    def on_arrival(self, request: Request, now: float) -> None:
        seq = self.next_seq()
        st = JobState(level=self.join_level(request), key=float(seq), seq=seq, clock=now)
        st.rank = (st.level, st.key, st.seq)
        st.entry = (st.level, st.key, st.seq, request)
        request.policy_state = st
        self.jobs[request.request_id] = request
        self.queues.push(request)

    def requeue(self, req: Request) -> None:
        # NOTE: FIFO inside a queue: a preempted job keeps its place (its key is unchanged).
        self.queues.push(req)

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        for rid in plan.num_scheduled_tokens:
            req = self.jobs.get(rid)
            if req is None:
                continue
            st: JobState = req.policy_state
            st.clock = now
            st.attained += result.total_s
            if quantum_spent(st.level, st.attained, self.quanta):
                waiting = self.unfile(req)
                st.level += 1
                st.attained = 0.0
                st.key = float(self.next_seq())  # the tail of the next queue
                st.rank = (st.level, st.key, st.seq)
                st.entry = (st.level, st.key, st.seq, req)
                self.refile(req, waiting)
