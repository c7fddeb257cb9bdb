"""The policy interface: a pure decision function over the scheduler's state.

A policy fills one step through the `StepBuilder` it is handed (schedule tokens, preempt,
swap in, resume); the builder does the KV allocation and budget arithmetic, so policies
never copy allocation code. Small hooks tell a policy about arrivals, finishes and step
results so it can keep its own indexes (MLFQ levels, groups, deadlines) in O(1) per
event. A policy never reads the clock (it is given `now`), never does I/O.

Adding a policy: one module under `scheduler_service/policies/` with a config dataclass,
a `Policy` subclass and `@POLICIES.register("name")`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvstore.accounting import AllocationMode
from sluice.common.config import config_from_options
from sluice.common.registry import Registry

if TYPE_CHECKING:
    from scheduler_service.core.request import Request
    from scheduler_service.core.step_builder import StepBuilder
    from scheduler_service.costmodel.base import CostModel
    from sluice.contract.plan import StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may know about the worker it schedules (fixed at construction)."""

    worker_id: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cost_model: CostModel | None = None  # prices steps; both drivers always give one
    tbt_slo_s: float | None = None  # the deployment's (or workload's) TBT SLO; None: not given
    int8_swap: bool = False  # swapped KV is int8-compressed (the worker supports it)


@dataclass
class PolicyConfig:
    """Fields every policy shares; subclasses add their own (each documented)."""

    preemption_mode: str = "recompute"  # recompute | swap (what KV pressure does)
    allocation: str = "block"  # block | max | exact | reserved (see kvstore.accounting)
    padding: float = 0.0  # extra share of the predicted length for exact allocation

    def __post_init__(self) -> None:
        """Every count, share, budget and duration of every policy is >= 0 (0 or None means
        "derive it" where a field says so); a negative one is refused, naming the option."""
        for name, value in vars(self).items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"option {name!r} must be >= 0, got {value}")

    @classmethod
    def from_options(cls, options: dict[str, str]) -> PolicyConfig:
        """Builds the config from `key=value` strings (CLI `--policy name:key=value,...`), each
        parsed by its field's type; an unknown key or a value that does not parse names the option."""
        return config_from_options(cls, options, cls.__name__)


class Policy(ABC):
    """Decides each step. Subclasses implement `schedule` and may override the hooks."""

    name: ClassVar[str] = "abstract"
    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig
    # A plan may be made while the previous one is in flight (overlapped scheduling,
    # core/overlap.py): the policy's decisions need nothing of a step's answer that one step of
    # lag changes beyond what the placeholder tokens allow (docs/ARCHITECTURE.md, the audit).
    overlap_safe: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        self.config = config
        self.ctx = ctx
        self.allocation_mode = AllocationMode(config.allocation)

    @abstractmethod
    def schedule(self, step: StepBuilder, now: float) -> None:
        """Fills `step` with this iteration's work."""

    def token_budget(self, now: float) -> int:
        """Tokens per step this policy aims for (compute utilization's denominator)."""
        return self.ctx.max_num_batched_tokens

    @property
    def int8_swap(self) -> bool:
        """Whether this policy's swaps move int8-compressed KV."""
        return self.ctx.int8_swap

    def on_arrival(self, request: Request, now: float) -> None:
        """A request joined this worker's waiting queue."""

    def on_prediction(self, request: Request, now: float) -> None:
        """The request's predicted output length changed after it arrived (a live prediction
        that came back while it waited). Policies that file requests by their prediction at
        arrival re-file them here; others read `predicted_output_tokens` where they use it."""

    def on_preempted(self, request: Request, now: float) -> None:
        """A request left the batch unfinished (its status says how)."""

    def on_paused(self, requests: list[Request], now: float) -> None:
        """Running requests were paused (kept, KV on the GPU) in one go; by default
        `on_preempted` of each, in order (queue policies pause dozens a step)."""
        for request in requests:
            self.on_preempted(request, now)

    def on_finished(self, request: Request, now: float) -> None:
        """A request finished, was aborted or timed out: drop any index entries."""

    def on_step_committed(self, plan: StepPlan, now: float) -> None:
        """The plan's step counts as done: its requests' computed and output token counts
        (and prefill-done status) include it. One step at a time this comes with the answer,
        just before `on_step_result` (the requests that ended at it are gone already); with
        overlap it comes when the plan is made, so bookkeeping on counts done here is seen by
        the very next plan, as it is without overlap (the requests that end at this step
        are still there: they end when its answer comes)."""

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """A step completed and request states are updated (with overlap: the answer to a plan
        made one step ago; counts are committed through the plan made since)."""

    def next_wakeup(self, now: float) -> float | None:
        """A time at which the policy wants `schedule` called even if nothing else happens
        (e.g. it holds requests back until then); None when it has no such need."""
        return None

    def stats_report(self) -> dict[str, object]:
        """Counters a policy keeps about its own decisions (e.g. EconoServe's regroups), for
        reports such as the simulator's `policy_stats`; empty for a policy that keeps none.
        Reading them must not change the policy's state."""
        return {}


POLICIES: Registry[type[Policy]] = Registry("policy")


def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`sarathi:budget=512,tile=128` -> ("sarathi", {"budget": "512", "tile": "128"})."""
    name, _, rest = spec.partition(":")
    options: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy option {item!r} in {spec!r} must be key=value")
        options[key.strip()] = value.strip()
    return name.strip(), options


def build_policy(spec: str, ctx: PolicyContext) -> Policy:
    name, options = parse_policy_spec(spec)
    cls = POLICIES.get(name)
    try:
        config = cls.config_cls.from_options(options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {spec!r}: {exc}") from None
    return cls(config, ctx)
