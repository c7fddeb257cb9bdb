"""The `vllm` engine: vLLM's worker and model runner execute Sluice's plans (not vLLM's scheduler).

    __init__      EngineArgs(...).create_engine_config() -> Executor (in process, one worker)
    init_kv_cache EngineCore's KV set-up, repeated with exactly num_gpu_blocks + 1 blocks (vLLM's
                  block 0 is its null block: our block b is its block b + 1) -> LayerTensorsKVCache
    execute(plan) PlanBook.check (the same rules as every engine) -> releases -> KV moves on
                  vLLM's tensors (worker_service/vllm_kv.py) -> the plan as a SchedulerOutput ->
                  execute_model + sample_tokens -> StepResult (the tokens of plan.sample_ids)

The translation, StepPlan -> vLLM's SchedulerOutput, per scheduled request, in the plan's order:

    first time in the runner   NewRequestData: every known token as the prompt (a recompute
                               resends prompt + generated), vLLM SamplingParams, the block
                               table (+1), num_computed_tokens as the book has it (a prefix hit
                               starts past 0; its shared blocks are in the table)
    known, table grew          CachedRequestData: the appended block ids, num_computed_tokens
    known, table replaced      the same, in resumed_req_ids with the whole table (back from a swap)
    every cached request       num_output_tokens = the tokens the runner sampled for it that
                               the plan asked for (anything else it sampled is trimmed by vLLM)
    released ids               finished_req_ids, sent with the next step (an empty step is fine)

A request the plan sends but does not schedule waits here until its first scheduled step: vLLM's
runner must only see scheduled requests. The runner keeps every request's tokens itself (it
appends what it samples), so a step planned before the previous one's tokens were known
(overlapped scheduling) needs nothing from us: its inputs are already in the runner.

vLLM is imported here only (and only when this engine is chosen); its APIs used here are not
public, so the version is pinned by the project's `vllm` extra and this module is tested
against it (tests/integration/test_vllm_engine.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvstore.paged import KVCacheSpec
from sluice.contract.limits import DEFAULT_MAX_NUM_SEQS
from sluice.contract.plan import NewRequestData, StepPlan, StepResult
from sluice.contract.sampling import SamplingParams
from worker_service.engine_contract import EngineConfig, EngineInfo, KVCapacity
from worker_service.hardware import HardwareInfo, describe_hardware
from worker_service.kv_moves import apply_kv_moves
from worker_service.model import resolve_config, resolve_dtype
from worker_service.model.config import ModelConfig
from worker_service.model.dummy import is_preset
from worker_service.plan_check import PlanBook, StepPlanError
from worker_service.vllm_kv import NULL_BLOCKS, LayerTensorsKVCache

# NOTE: in-process executor: the CPU platform otherwise starts a worker process, and the runner's
# tensors (the KV our swaps read) would live in another process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    kv_cache_groups_tp_replicas,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.core.sched.output import NewRequestData as VllmNewRequest
from vllm.v1.engine.core import resolve_kv_cache_layout
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import group_kernel_blocks

log = logging.getLogger(__name__)

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
CPU_MEMORY_UTILIZATION = 0.05  # NOTE: on CPU vLLM reserves this share of host RAM at start; our KV is sized apart
MIN_BATCHED_TOKENS = 8192


def vllm_block_size(requested: int, device: str) -> int:
    """The block size this engine runs: the requested one, rounded up to vLLM's CPU multiple."""
    if device.startswith("cpu") and requested % CPU_BLOCK_MULTIPLE:
        return -(-requested // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
    return requested


def hf_config_dict(c: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config.json for one of our presets (vLLM builds its model from one)."""
    common = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "eos_token_id": list(c.eos_token_ids),
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    if c.family == "opt":
        return {
            **common,
            "architectures": ["OPTForCausalLM"],
            "model_type": "opt",
            "ffn_dim": c.intermediate_size,
            "word_embed_proj_dim": c.word_embed_proj_dim or c.hidden_size,
            "activation_function": c.activation,
            "do_layer_norm_before": True,
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "pad_token_id": 1,
            "bos_token_id": 2,
        }
    return {
        **common,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": c.intermediate_size,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "hidden_act": "silu",
    }


def model_directory(model: str) -> str:
    """A directory vLLM can load: the model's own, or a config.json written for a preset."""
    if not is_preset(model):
        return model
    import json

    folder = Path(tempfile.mkdtemp(prefix=f"sluice-{model}-"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(resolve_config(model))))
    return str(folder)


def to_vllm_sampling(s: SamplingParams, eos_token_ids: Iterable[int], rid: str) -> VllmSamplingParams:
    """Our sampling parameters, one to one (OpenAI names on both sides). Stop strings and
    max_tokens are the scheduler's to apply; the runner needs the stop ids for min_tokens.
    StepPlanError naming the field when vLLM refuses a value."""
    try:
        params = VllmSamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            min_tokens=s.min_tokens,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            stop_token_ids=list(s.stop_token_ids),
            detokenize=False,
        )
    except ValueError as exc:
        raise StepPlanError(f"sampling_params: vLLM refuses them: {exc}", rid) from exc
    if not s.ignore_eos:
        params.all_stop_token_ids.update(eos_token_ids)
    return params


@dataclass(slots=True)
class RunnerRequest:
    """What this engine knows of a request beyond the book: whether vLLM's runner holds it yet,
    the block table (vLLM's ids) it holds, and the tokens it sampled that the plans asked for."""

    new: NewRequestData
    sampling: VllmSamplingParams
    in_runner: bool = False
    table: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    blocks: list[int] | None = None  # the book's block list `table` was made from


@dataclass(slots=True)
class VllmLaunched:
    """A step of this engine: done by the time `launch` returns (vLLM's CPU runner is synchronous)."""

    result: StepResult
    device_end: float | None = None

    def wait(self) -> None:
        """Nothing left to wait for."""


class VllmEngine:
    """An `Engine` (worker_service/engine_contract.py) over vLLM's model runner."""

    async_device_s = 0.0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = resolve_config(config.model)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = vllm_block_size(config.block_size, config.device)
        if self.block_size != config.block_size:
            log.warning("block size %d -> %d (vLLM's CPU attention)", config.block_size, self.block_size)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or limit
        if not 0 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len {self.max_model_len} must be in [1, {limit}] for {config.model}")
        self.max_num_batched_tokens = max(MIN_BATCHED_TOKENS, self.max_model_len)
        self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        self.eos_token_ids = self.model_config.eos_token_ids
        self._model_dir = model_directory(config.model)
        self.executor: Any = None
        self._build_executor(num_gpu_blocks=None)
        self.book = PlanBook(self.block_size, self.max_model_len, self.model_config.vocab_size)
        self.cache: LayerTensorsKVCache | None = None
        self.requests: dict[str, RunnerRequest] = {}
        self._to_finish: set[str] = set()  # released here, not told to the runner yet

    # -- the Engine contract ---------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        spec = self._spec()
        return EngineInfo.describe(
            replace(self.config, block_size=self.block_size),
            self.model_config,
            family=self.model_config.family,
            dtype=str(self.dtype).removeprefix("torch."),
            dtype_bytes=self.dtype.itemsize,
            device=str(self.device),
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            bytes_per_block=spec.bytes_per_block,
            supports_int8=spec.supports_int8,
        )

    @property
    def hardware(self) -> HardwareInfo:
        return describe_hardware(self.device, self.dtype)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def measure_kv_capacity(
        self, gpu_memory_utilization: float, swap_space_gib: float, max_num_batched_tokens: int
    ) -> KVCapacity:
        """Blocks that fit in the share of device memory left once vLLM's weights and an estimate
        of a max_num_batched_tokens forward pass's activations are counted."""
        per_block = self._spec().bytes_per_block
        weights = sum(p.numel() * p.element_size() for p in self._runner.model.parameters())
        c = self.model_config
        per_token = 2 * c.hidden_size + c.q_size + 2 * c.kv_size + 3 * c.intermediate_size
        peak = max_num_batched_tokens * per_token * self.dtype.itemsize
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(total * gpu_memory_utilization) - weights - peak
        return KVCapacity(max(0, budget // per_block), int(swap_space_gib * 2**30) // per_block, per_block, peak)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """vLLM's KV for exactly `num_gpu_blocks` of ours (plus its null block); a new count
        rebuilds the executor (vLLM binds its KV once), the same count clears it."""
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need >= 1 GPU block and >= 0 CPU blocks, got {num_gpu_blocks}, {num_cpu_blocks}")
        self._to_finish |= {rid for rid, r in self.requests.items() if r.in_runner}
        self.requests.clear()
        if self.cache is not None and self.cache.num_gpu_blocks != num_gpu_blocks:
            self._build_executor(num_gpu_blocks)
            self._to_finish.clear()
            self.cache = None
        if self.cache is None:
            layers = self._allocate_kv(num_gpu_blocks)
            self.cache = LayerTensorsKVCache(self._spec(), layers, 0, num_gpu_blocks, num_cpu_blocks)
        else:
            self.cache.zero()
            self.cache = LayerTensorsKVCache(
                self._spec(), self.cache.layers, self.cache.block_dim, num_gpu_blocks, num_cpu_blocks
            )
        self.book.reset(num_gpu_blocks, num_cpu_blocks)

    def warm_up(self) -> None:
        """vLLM compiled and warmed its model when the KV cache was bound. vLLM's environment
        settings are left uncached (its EngineCore caches them once set up): cached, every later
        vLLM engine of the process reads the first one's (docs/results/vllm_engine.md, "The
        per-step hand-off and the worker's other threads")."""

    def release(self, request_ids: Iterable[str]) -> list[str]:
        released = self.book.release(request_ids)
        for rid in released:
            state = self.requests.pop(rid)
            if state.in_runner:
                self._to_finish.add(rid)
        return released

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> VllmLaunched:
        return VllmLaunched(self._run(plan))

    def collect(self, launched: VllmLaunched) -> StepResult:
        return launched.result

    # -- one step ----------------------------------------------------------------------------

    def _run(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        if self.cache is None and (plan.num_scheduled_tokens or plan.kv_moves or plan.new_requests):
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        self._check_limits(plan)
        staged = self.book.check(plan)
        admitted = {new.request_id: self._admission(new) for new in plan.new_requests}
        self.release(plan.release_ids)
        for new in plan.new_requests:
            self.requests[new.request_id] = RunnerRequest(new, admitted[new.request_id])
        swap_s, swap_bytes = 0.0, 0
        if self.cache is not None:  # checked above: no moves come before Warmup
            sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
            swap_s, swap_bytes = apply_kv_moves(self.cache, plan.kv_moves, sync)
        self.book.commit(staged)
        output = self._scheduler_output(plan)
        prepared = time.perf_counter()
        sampled: dict[str, int] = {}
        if output.total_num_scheduled_tokens or output.finished_req_ids:
            sampled = self._forward(output, plan.sample_ids)
        forward_end = time.perf_counter()
        for rid in sampled:
            self.requests[rid].num_output_tokens += 1
        self.book.advance(plan, sampled)
        return StepResult(
            step_id=plan.step_id,
            sampled_token_ids=sampled,
            total_s=time.perf_counter() - start,
            forward_s=forward_end - prepared,
            swap_s=swap_s,
            prepare_s=max(0.0, prepared - start - swap_s),
            swap_bytes=swap_bytes,
        )

    def _check_limits(self, plan: StepPlan) -> None:
        if plan.total_num_scheduled_tokens > self.max_num_batched_tokens:
            raise StepPlanError(
                f"{plan.total_num_scheduled_tokens} tokens in one step exceed this engine's "
                f"max_num_batched_tokens {self.max_num_batched_tokens}"
            )
        if len(plan.num_scheduled_tokens) > self.max_num_seqs:
            raise StepPlanError(
                f"{len(plan.num_scheduled_tokens)} requests in one step exceed max_num_seqs {self.max_num_seqs}"
            )

    def _admission(self, new: NewRequestData) -> VllmSamplingParams:
        """vLLM's sampling parameters for a new request (StepPlanError naming the field if refused);
        the book has checked our own rules already."""
        if len(new.prompt_token_ids) > self.max_model_len:
            # NOTE: vLLM's runner holds at most max_model_len tokens a request (a longer prompt
            # breaks its persistent batch), though a plan may only ever schedule a prefix of it.
            raise StepPlanError(
                f"prompt_token_ids: {len(new.prompt_token_ids)} tokens exceed max_model_len {self.max_model_len}",
                new.request_id,
            )
        return to_vllm_sampling(new.sampling, self.eos_token_ids, new.request_id)

    def _scheduler_output(self, plan: StepPlan) -> SchedulerOutput:
        new_reqs: list[VllmNewRequest] = []
        cached = CachedRequestData.make_empty()
        entries = self.book.entries
        for rid in plan.num_scheduled_tokens:
            state, entry = self.requests[rid], entries[rid]
            blocks = entry.gpu
            if not state.in_runner:
                table = [b + NULL_BLOCKS for b in blocks]
                new_reqs.append(self._new_request(state, table, entry.num_computed_tokens))
                state.in_runner, state.table, state.blocks = True, table, blocks
                continue
            cached.req_ids.append(rid)
            cached.new_token_ids.append([])
            cached.num_computed_tokens.append(entry.num_computed_tokens)
            cached.num_output_tokens.append(state.num_output_tokens)
            # NOTE: the book replaces a request's block list whenever it changes (never edits it in
            # place), so the list it held last step means an unchanged table: most decode steps.
            if blocks is state.blocks:
                cached.new_block_ids.append(None)
                continue
            table = [b + NULL_BLOCKS for b in blocks]
            known = len(state.table)
            resumed = table[:known] != state.table
            grown = table if resumed else table[known:]
            cached.new_block_ids.append((grown,) if grown or resumed else None)
            if resumed:
                cached.resumed_req_ids.add(rid)
            state.table, state.blocks = table, blocks
        finished, self._to_finish = self._to_finish, set()
        scheduled = dict(plan.num_scheduled_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0],
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
        )

    def _new_request(self, state: RunnerRequest, table: list[int], num_computed: int) -> VllmNewRequest:
        state.num_output_tokens = 0
        return VllmNewRequest(
            req_id=state.new.request_id,
            prompt_token_ids=list(state.new.prompt_token_ids),
            mm_features=[],
            sampling_params=state.sampling,
            pooling_params=None,
            block_ids=(table,),
            num_computed_tokens=num_computed,
            lora_request=None,
        )

    def _forward(self, output: SchedulerOutput, sample_ids: frozenset[str]) -> dict[str, int]:
        """vLLM's forward and sampler; the tokens of the requests the plan samples."""
        out = self.executor.execute_model(output)
        if out is None:
            out = self.executor.sample_tokens(None)
        sampled: dict[str, int] = {}
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if rid in sample_ids and len(tokens):
                sampled[rid] = int(tokens[-1])
        missing = sample_ids - sampled.keys()
        if missing:
            raise RuntimeError(f"vLLM sampled no token for {sorted(missing)}")
        return sampled

    # -- vLLM set-up -------------------------------------------------------------------------

    @property
    def _runner(self) -> Any:
        return self.executor.driver_worker.worker.model_runner

    def _build_executor(self, num_gpu_blocks: int | None) -> None:
        if self.executor is not None:
            self.executor.shutdown()
        load_format = self.config.load_format
        if load_format == "auto":
            load_format = "dummy" if is_preset(self.config.model) else "auto"
        args = EngineArgs(
            model=self._model_dir,
            load_format=load_format,
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.block_size,
            seed=self.config.seed,
            max_model_len=self.max_model_len,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,  # NOTE: Sluice's scheduler decides prefix hits, not vLLM's
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_gpu_blocks_override=None if num_gpu_blocks is None else num_gpu_blocks + NULL_BLOCKS,
            gpu_memory_utilization=CPU_MEMORY_UTILIZATION if self.device.type == "cpu" else 0.9,
            enforce_eager=not self.config.vllm_compile,
        )
        self.vllm_config = args.create_engine_config()
        self.executor = Executor.get_class(self.vllm_config)(self.vllm_config)
        self._kv_specs = self.executor.get_kv_cache_specs()

    def _allocate_kv(self, num_gpu_blocks: int) -> list[torch.Tensor]:
        """EngineCore._initialize_kv_caches, with the block count given instead of measured."""
        cfg, executor, specs = self.vllm_config, self.executor, self._kv_specs
        layout = resolve_kv_cache_layout(
            cfg, executor.get_supported_kv_cache_layouts(), [s for worker in specs for s in worker.values()]
        )
        executor.set_kv_cache_layout(layout.name)
        num_blocks = num_gpu_blocks + NULL_BLOCKS
        page_bytes = sum(s.page_size_bytes for s in specs[0].values())
        cfg.cache_config.num_gpu_blocks_override = num_blocks
        # NOTE: get_kv_cache_configs would refuse a cache shorter than one max_model_len request:
        # that is its scheduler's rule; ours sizes every request against the blocks it owns, so
        # the groups are built and sized directly (one worker, no pipeline stages).
        groups = get_kv_cache_groups(cfg, dict(specs[0]))
        config = get_kv_cache_config_from_groups(cfg, groups, page_bytes * num_blocks)
        par = cfg.parallel_config
        config.kv_tp_replicas = kv_cache_groups_tp_replicas(
            config.kv_cache_groups, par.tensor_parallel_size, par.decode_context_parallel_size
        )
        config.kv_cache_layout = cfg.cache_config.kv_cache_layout
        configs = [config]
        if config.num_blocks != num_blocks:
            raise MemoryError(f"vLLM made {config.num_blocks} KV blocks of the {num_blocks} asked")
        cfg.cache_config.num_gpu_blocks = num_blocks
        executor.initialize_from_config(configs)
        executor.compile_or_warm_up_model()
        # NOTE: vLLM's layer caches are logically [blocks, heads, kernel states, bytes] whatever the
        # physical layout; a backend that splits blocks into kernel blocks is viewed per block again.
        return [group_kernel_blocks(t, num_blocks) for t in self._runner.kv_caches]

    def _spec(self) -> KVCacheSpec:
        layers = list(self._kv_specs[0].values())
        first = layers[0]
        return KVCacheSpec(len(layers), first.num_kv_heads, first.head_size, self.block_size, first.dtype)
