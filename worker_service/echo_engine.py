"""An engine-free worker engine for load tests: checks every plan, runs no model.

    WorkerServicer --StepPlan--> EchoEngine.execute: validate (all or nothing) -> apply
        tables, computed tokens and KV moves as bookkeeping -> synthetic token per sample id

`sluice worker --engine echo` serves it behind the real gRPC worker (health, Warmup,
Execute, Release), so the scheduler, the wire and the worker's own plan decoding are
measured without a forward pass: what is left of a step is the system's overhead. It
exposes the LLMEngine methods the server uses (`info`, `spec.supports_int8`,
`num_requests`, `measure_kv_capacity`, `init_kv_cache`, `execute`, `release`).

Checks are the engine's rules (known ids, computed-token agreement, blocks in range and
owned by one request, enough blocks for the scheduled tokens, sampling only at the end of
the known tokens), done incrementally: block ownership is a map updated with the blocks a
plan adds, so a step costs O(its diff), not O(all blocks held). Sampled tokens are fixed
common word pieces cycling with the position, never an EOS id, so requests run to their
max_tokens. `step_time_s` optionally sleeps to mimic a device step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler_service.core.plan import KVMoveKind, StepPlan, StepResult
from scheduler_service.core.sampling import InvalidRequestError
from worker_service.engine import EngineConfig, EngineInfo, KVCapacity, StepPlanError
from worker_service.model import resolve_config

ECHO_FIRST_TOKEN = 1996  # "the" in the MiniLM vocabulary of the tiny presets; ids above are common words
ECHO_CYCLE = 1000
ECHO_GPU_BLOCKS = 65536  # blocks reported when Warmup asks the echo engine to measure


@dataclass(frozen=True, slots=True)
class EchoSpec:
    bytes_per_block: int
    supports_int8: bool = True


@dataclass(slots=True)
class _EchoRequest:
    num_tokens: int
    num_computed_tokens: int
    gpu: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)


class EchoEngine:
    """Bookkeeping of an LLMEngine without the model; see the module docstring."""

    def __init__(self, config: EngineConfig, step_time_s: float = 0.0) -> None:
        self.config = config
        self.model_config = resolve_config(config.model)
        c = self.model_config
        self.max_model_len = config.max_model_len or c.max_position_embeddings
        self.spec = EchoSpec(bytes_per_block=2 * c.num_layers * c.num_kv_heads * c.head_dim * config.block_size * 2)
        self.step_time_s = step_time_s
        self.num_gpu_blocks = 0
        self.num_cpu_blocks = 0
        self.requests: dict[str, _EchoRequest] = {}
        self.gpu_owner: dict[int, str] = {}
        self.cpu_owner: dict[int, str] = {}
        eos = set(c.eos_token_ids)
        vocab = c.vocab_size
        self._cycle = [
            t % vocab for t in range(ECHO_FIRST_TOKEN, ECHO_FIRST_TOKEN + ECHO_CYCLE) if t % vocab not in eos
        ]

    # -- the LLMEngine surface the worker server uses ------------------------------------
    @property
    def info(self) -> EngineInfo:
        c = self.model_config
        return EngineInfo(
            model=self.config.model,
            family=f"{c.family} (echo)",
            dtype="none",
            device="cpu",
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            vocab_size=c.vocab_size,
            eos_token_ids=tuple(c.eos_token_ids),
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            bytes_per_block=self.spec.bytes_per_block,
        )

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def measure_kv_capacity(
        self, gpu_memory_utilization: float, swap_space_gib: float, max_num_batched_tokens: int
    ) -> KVCapacity:
        cpu = int(swap_space_gib * 2**30) // self.spec.bytes_per_block
        return KVCapacity(ECHO_GPU_BLOCKS, cpu, self.spec.bytes_per_block, 0)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need >= 1 GPU block and >= 0 CPU blocks, got {num_gpu_blocks}, {num_cpu_blocks}")
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.requests.clear()
        self.gpu_owner.clear()
        self.cpu_owner.clear()

    def release(self, request_ids: Iterable[str]) -> list[str]:
        released = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                for b in state.gpu:
                    self.gpu_owner.pop(b, None)
                for b in state.cpu:
                    self.cpu_owner.pop(b, None)
                released.append(rid)
        return released

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        if not self.num_gpu_blocks and (plan.num_scheduled_tokens or plan.new_requests or plan.kv_moves):
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        staged = _Staged(self, plan.release_ids)
        staged.check(plan)
        self.release(plan.release_ids)
        swap_bytes = staged.commit()
        sampled = self._advance(plan)
        if self.step_time_s:
            time.sleep(self.step_time_s)
        return StepResult(
            step_id=plan.step_id,
            sampled_token_ids=sampled,
            total_s=time.perf_counter() - start,
            swap_bytes=swap_bytes,
        )

    def _advance(self, plan: StepPlan) -> dict[str, int]:
        sampled: dict[str, int] = {}
        for rid, n in plan.num_scheduled_tokens.items():
            state = self.requests[rid]
            state.num_computed_tokens += n
            if rid in plan.sample_ids:
                sampled[rid] = self._cycle[state.num_tokens % len(self._cycle)]
                state.num_tokens += 1
        return sampled


class _Staged:
    """One plan's changes, checked against the engine before any of them is applied."""

    def __init__(self, engine: EchoEngine, release_ids: Iterable[str]) -> None:
        self.engine = engine
        self.released = {rid for rid in release_ids if rid in engine.requests}
        self.states: dict[str, _EchoRequest] = {}  # copies of the requests this plan touches
        self.new_gpu: dict[int, str] = {}
        self.new_cpu: dict[int, str] = {}
        self.freed_gpu: set[int] = set()
        self.freed_cpu: set[int] = set()
        self.swap_blocks = 0
        self.claims: list[tuple[str, str, tuple[int, ...]]] = []

    def _state(self, rid: str, what: str) -> _EchoRequest:
        state = self.states.get(rid)
        if state is None:
            live = self.engine.requests.get(rid)
            if live is None or rid in self.released:
                raise StepPlanError(f"{what}: request unknown to the worker", rid)
            state = self.states[rid] = _EchoRequest(live.num_tokens, live.num_computed_tokens, live.gpu, live.cpu)
        return state

    def _claim(self, rid: str, blocks: Iterable[int], tier: str) -> None:
        """Records blocks a request takes; checked in `_check_claims` once all frees are known."""
        self.claims.append((tier, rid, tuple(blocks)))

    def _check_claims(self) -> None:
        engine = self.engine
        for tier, rid, blocks in self.claims:
            num, owner, new, freed = (
                (engine.num_gpu_blocks, engine.gpu_owner, self.new_gpu, self.freed_gpu)
                if tier == "GPU"
                else (engine.num_cpu_blocks, engine.cpu_owner, self.new_cpu, self.freed_cpu)
            )
            for b in blocks:
                if not 0 <= b < num:
                    raise StepPlanError(f"{tier} block {b} out of range [0, {num})", rid)
                if b in new:
                    raise StepPlanError(f"{tier} block {b} given to both {new[b]!r} and {rid!r}", rid)
                held = owner.get(b)
                if held is not None and held != rid and b not in freed and held not in self.released:
                    raise StepPlanError(f"{tier} block {b} given to both {held!r} and {rid!r}", rid)
                new[b] = rid

    def check(self, plan: StepPlan) -> None:
        for new in plan.new_requests:
            rid = new.request_id
            if rid in self.states or (rid in self.engine.requests and rid not in self.released):
                raise StepPlanError("sent as new but already known to the worker", rid)
            if len(new.prompt_token_ids) != new.num_tokens or not new.prompt_token_ids:
                raise StepPlanError(f"prompt_token_ids has {len(new.prompt_token_ids)} ids", rid)
            if not 0 <= new.num_computed_tokens <= new.num_tokens:
                raise StepPlanError(f"num_computed_tokens {new.num_computed_tokens} outside [0, num_tokens]", rid)
            try:
                new.sampling.validate()
            except InvalidRequestError as exc:
                raise StepPlanError(str(exc), rid) from None
            self._claim(rid, new.block_ids, "GPU")
            self.states[rid] = _EchoRequest(new.num_tokens, new.num_computed_tokens, list(new.block_ids), [])
        self._check_cached(plan)
        self._check_moves(plan)
        self._check_scheduled(plan)
        self._check_claims()

    def _check_cached(self, plan: StepPlan) -> None:
        c = plan.cached_requests
        new_ids = {n.request_id for n in plan.new_requests} if plan.new_requests else set()
        for rid, blocks, resumed, computed in zip(
            c.request_ids, c.new_block_ids, c.resumed, c.num_computed_tokens, strict=True
        ):
            if rid in new_ids:
                raise StepPlanError("cached request sent as new in the same plan", rid)
            state = self._state(rid, "cached")
            if computed != state.num_computed_tokens:
                raise StepPlanError(f"num_computed_tokens {computed} != worker's {state.num_computed_tokens}", rid)
            if resumed:
                self.freed_gpu.update(b for b in state.gpu if b not in blocks)
                state.gpu = list(blocks)
            else:
                state.gpu = state.gpu + list(blocks)
            self._claim(rid, blocks, "GPU")

    def _check_moves(self, plan: StepPlan) -> None:
        for move in plan.kv_moves:
            rid = move.request_id
            state = self._state(rid, f"KV move {move.kind.name}")
            src, dst = list(move.src_block_ids), list(move.dst_block_ids)
            if len(src) != len(dst):
                raise StepPlanError(f"KV move {move.kind.name}: {len(src)} sources, {len(dst)} destinations", rid)
            if move.kind is KVMoveKind.SWAP_OUT:
                if src != state.gpu:
                    raise StepPlanError("swap-out sources are not the request's block table", rid)
                self._claim(rid, dst, "CPU")
                self.freed_gpu.update(src)
                state.gpu, state.cpu = [], state.cpu + dst
            elif move.kind is KVMoveKind.SWAP_IN:
                if not set(src) <= set(state.cpu) or not set(dst) <= set(state.gpu):
                    raise StepPlanError("swap-in must read the request's CPU blocks into its block table", rid)
                self.freed_cpu.update(src)
                state.cpu = [b for b in state.cpu if b not in set(src)]
            elif not set(dst) <= set(state.gpu):
                raise StepPlanError("copy destinations must be in the request's block table", rid)
            self.swap_blocks += len(src)

    def _check_scheduled(self, plan: StepPlan) -> None:
        block_size, max_len = self.engine.config.block_size, self.engine.max_model_len
        states, live, released = self.states, self.engine.requests, self.released
        for rid, n in plan.num_scheduled_tokens.items():
            # NOTE: read, not copied: scheduling alone changes no table (the hot path at 256 decodes)
            state = states.get(rid) or (live.get(rid) if rid not in released else None)
            if state is None:
                raise StepPlanError("scheduled: request unknown to the worker", rid)
            end = state.num_computed_tokens + n
            if n < 1 or end > state.num_tokens:
                raise StepPlanError(f"schedules tokens [{state.num_computed_tokens}, {end}) of {state.num_tokens}", rid)
            if end > max_len:
                raise StepPlanError(f"{end} tokens exceed max_model_len {max_len}", rid)
            if len(state.gpu) * block_size < end:
                raise StepPlanError(f"{len(state.gpu)} blocks cannot hold {end} tokens", rid)
            if rid in plan.sample_ids and end != state.num_tokens:
                raise StepPlanError("samples before the end of its known tokens", rid)
        for rid in plan.sample_ids:
            if rid not in plan.num_scheduled_tokens:
                raise StepPlanError("samples but is not scheduled", rid)

    def commit(self) -> int:
        """Applies the checked changes; returns the swapped bytes."""
        engine = self.engine
        for b in self.freed_gpu:
            engine.gpu_owner.pop(b, None)
        for b in self.freed_cpu:
            engine.cpu_owner.pop(b, None)
        engine.gpu_owner.update(self.new_gpu)
        engine.cpu_owner.update(self.new_cpu)
        for rid, state in self.states.items():
            live = engine.requests.get(rid)
            if live is None or rid in self.released:
                engine.requests[rid] = state
            else:
                live.gpu, live.cpu = state.gpu, state.cpu
        return self.swap_blocks * engine.spec.bytes_per_block
