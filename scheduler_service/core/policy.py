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
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from kvstore.accounting import AllocationMode
from scheduler_service.registry import Registry

if TYPE_CHECKING:
    from scheduler_service.core.plan import StepPlan, StepResult
    from scheduler_service.core.request import Request
    from scheduler_service.core.step_builder import StepBuilder
    from scheduler_service.costmodel.base import CostModel


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
    cost_model: CostModel | None = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyConfig:
    """Fields every policy shares; subclasses add their own (each documented)."""

    preemption_mode: str = "recompute"  # recompute | swap (what KV pressure does)
    allocation: str = "block"  # block | max | exact | reserved (see kvstore.accounting)
    padding: float = 0.0  # extra share of the predicted length for exact allocation

    @classmethod
    def from_options(cls, options: dict[str, str]) -> PolicyConfig:
        """Builds the config from `key=value` strings (CLI `--policy name:key=value,...`)."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in options.items():
            if key not in known:
                raise ValueError(f"{cls.__name__} has no option {key!r}; known: {', '.join(sorted(known))}")
            values[key] = _parse_value(raw, known[key].type)
        return cls(**values)


def _parse_value(raw: str, type_name: Any) -> Any:
    text = str(type_name)
    if "bool" in text:
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"not a boolean: {raw!r}")
        return raw.lower() in ("1", "true", "yes", "on")
    if raw.lower() == "none" and "None" in text:
        return None
    if "int" in text and "float" not in text:
        return int(raw)
    if "float" in text:
        return float(raw)
    return raw


class Policy(ABC):
    """Decides each step. Subclasses implement `schedule` and may override the hooks."""

    name: ClassVar[str] = "abstract"
    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig

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

    def on_arrival(self, request: Request, now: float) -> None:
        """A request joined this worker's waiting queue."""

    def on_preempted(self, request: Request, now: float) -> None:
        """A request left the batch unfinished (its status says how)."""

    def on_finished(self, request: Request, now: float) -> None:
        """A request finished, was aborted or timed out: drop any index entries."""

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """A step completed and request states are updated."""

    def next_wakeup(self, now: float) -> float | None:
        """A time at which the policy wants `schedule` called even if nothing else happens
        (e.g. it holds requests back until then); None when it has no such need."""
        return None


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
    return cls(cls.config_cls.from_options(options), ctx)
