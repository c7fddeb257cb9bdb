"""A real scheduler over a small block pool, fed fabricated step results (the vLLM
test pattern); every test ends with the leak check."""

from __future__ import annotations

from kvstore.accounting import KVCacheManager
from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig, StepOutputs
from scheduler_service.core.slo import NO_SLO, SLOSpec
from sluice.contract.plan import StepPlan, StepResult
from sluice.contract.sampling import SamplingParams

EOS = 0
TOKEN = 7


def make_scheduler(
    policy: str,
    *,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    tbt_slo_s: float | None = None,
    int8_swap: bool = False,
    prefix_caching: bool = False,
    **config: object,
) -> Scheduler:
    kv = KVCacheManager(num_gpu_blocks, num_cpu_blocks, block_size, prefix_caching=prefix_caching)
    ctx = PolicyContext(
        worker_id=0,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        tbt_slo_s=tbt_slo_s,
        int8_swap=int8_swap,
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        **config,  # type: ignore[arg-type]
    )
    return Scheduler(0, kv, build_policy(policy, ctx), sched_cfg)


def make_request(
    rid: str,
    prompt: int,
    output: int,
    *,
    arrival: float = 0.0,
    max_tokens: int | None = None,
    slo: SLOSpec = NO_SLO,
    priority: int = 0,
) -> Request:
    """A request whose fabricated results end it with EOS after `output` tokens."""
    return Request(
        rid,
        arrival_time=arrival,
        prompt_token_ids=list(range(1, prompt + 1)),
        sampling=SamplingParams(max_tokens=max_tokens or output + 8),
        slo=slo,
        priority=priority,
        eos_token_ids=frozenset({EOS}),
        true_output_tokens=output,
    )


def fake_result(sched: Scheduler, plan: StepPlan, duration: float = 0.01) -> StepResult:
    """What a worker would answer: a token per sampled request, EOS at its true length."""
    sampled = {}
    for rid in plan.sample_ids:
        req = sched.requests[rid]
        done = req.num_output_tokens + 1 >= (req.true_output_tokens or 1)
        sampled[rid] = EOS if done else TOKEN
    return StepResult(plan.step_id, sampled, total_s=duration)


def step(sched: Scheduler, now: float) -> tuple[StepPlan, StepOutputs]:
    plan = sched.schedule(now)
    sched.kv.check_invariants()
    out = sched.on_step_result(fake_result(sched, plan), now + 0.01)
    sched.kv.check_invariants()
    return plan, out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    now = 0.0
    for _ in range(max_steps):
        if not sched.has_work:
            return plans
        plan, _ = step(sched, now)
        plans.append(plan)
        now += 0.01
    raise AssertionError("requests did not finish")


class LeasedStub:
    """A WorkerService stub whose calls carry the lease's session (the `x-sluice-session`
    metadata a Warmup answered), as the scheduler's RemoteWorker sends it."""

    def __init__(self, stub: object, session_id: str, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.stub = stub
        self.metadata = (("x-sluice-session", session_id), *extra)

    def __getattr__(self, name: str) -> object:
        method = getattr(self.stub, name)

        def call(*args: object, **kwargs: object) -> object:
            kwargs.setdefault("metadata", self.metadata)
            return method(*args, **kwargs)

        return call
