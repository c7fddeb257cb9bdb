"""Shared by the vLLM plug-in's tests and its benchmark (benchmarks/vllm_plugin.py): a tiny
Llama config (dummy weights, no download), vLLM's real scheduler classes built without a model,
synthetic requests, and a step driver that plays the model's part (one sampled token per
scheduled decode)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

# a tiny Llama's config (no weights: vLLM loads dummy ones), in the tests' data
TINY_MODEL = str(Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-llama-vllm")
BLOCK_SIZE = 32  # CPU KV blocks are multiples of 32


def engine_config(max_num_seqs: int = 16, max_num_batched_tokens: int = 1024, num_blocks: int = 64, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=TINY_MODEL,
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.1,
        **kw,
    )
    cfg = args.create_engine_config()
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def build_scheduler(cls: type, num_blocks: int = 64, env: dict[str, str] | None = None, **kw: Any) -> Any:
    """`cls` (a vLLM scheduler class) over a KV cache of `num_blocks` blocks, no model.
    `env` sets the plug-in's environment while it reads it."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = engine_config(num_blocks=num_blocks, **kw)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return cls(
            vllm_config=cfg,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BLOCK_SIZE,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_request(
    rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, priority: int = 0, **extra: Any
) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
    return Request(rid, [7] * prompt_len, sp, None, arrival_time=arrival, priority=priority)


def step(scheduler: Any, model_s: float = 0.0) -> Any:
    """One schedule() plus a model output, `model_s` seconds later, that samples token 5 for
    each request that completed its prompt; returns the SchedulerOutput."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    if model_s:
        time.sleep(model_s)
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done_prompt = req.num_computed_tokens >= req.num_prompt_tokens  # vLLM advanced it in schedule()
        sampled.append([5] if done_prompt else [])
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)
    scheduler.update_from_output(out, mro)
    return out
