"""CUDA paths: swaps on their own stream with pinned host memory, int8 on the device, greedy
parity of the paged engine against the dense reference (fp32 exact; bf16 and fp16 to the
precision's own noise), the Triton and torch attention paths against each other, and the
decode CUDA graphs (padding rows never touch a block the scheduler owns)."""

from __future__ import annotations

import copy

import pytest
import torch
from worker_harness import (
    MiniScheduler,
    budget_schedule,
    dense_greedy,
    dense_logits,
    int8_swap_round_trip,
    make_engine,
    random_prompt,
)

from kvstore.paged import KVCacheSpec, PagedKVCache
from sluice.contract.plan import StepResult
from worker_service.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_swap_round_trip_on_the_swap_stream_is_exact_and_overlaps_nothing_unsafe() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 16, 16, torch.device("cuda"))
    assert cache.cpu.is_pinned()
    cache.kv.normal_()
    before = cache.kv[:, :, [3, 4, 9]].clone()
    with cache.swapping():
        cache.swap_out([3, 4, 9], [0, 1, 5], int8=False)
    cache.kv[:, :, [3, 4, 9]] = 0  # the forward pass may reuse freed blocks at once
    with cache.swapping():
        cache.swap_in([0, 1, 5], [10, 11, 12])
    torch.cuda.synchronize()
    assert torch.equal(cache.kv[:, :, [10, 11, 12]], before)
    assert cache.last_swap_seconds() >= 0.0


def test_int8_swap_on_cuda_stays_within_half_a_step() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 8, 8, torch.device("cuda"))
    cache.kv.normal_()
    before = cache.kv[:, :, [1, 2]].float().clone()
    with cache.swapping():
        cache.swap_out([1, 2], [6, 7], int8=True)
        cache.swap_in([6, 7], [4, 5])
    torch.cuda.synchronize()
    span = before.amax(dim=3, keepdim=True) - before.amin(dim=3, keepdim=True)
    err = (cache.kv[:, :, [4, 5]].float() - before).abs()
    assert bool((err <= span / 510 + 2e-2).all())  # plus bf16 rounding of the dequantized value


def greedy_run(engine: LLMEngine, prompts: dict[str, list[int]], num_output: int) -> MiniScheduler:
    sched = MiniScheduler(engine)
    for rid, p in prompts.items():
        sched.add(rid, p)
    for step in range(60):
        active = [r for r in prompts if len(sched.outputs(r)) < num_output]
        if not active:
            break
        sched.step(budget_schedule(sched, active, 7, (4, 3, 5), step))
    return sched


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_paged_engine_matches_dense_greedy_on_cuda(cuda_graphs: bool) -> None:
    engine = make_engine("tiny-llama", 64, 16, block_size=4, device="cuda", cuda_graphs=cuda_graphs)
    assert engine.attention == "triton"
    prompts = {f"g{i}": random_prompt(5 + 6 * i, seed=70 + i) for i in range(3)}
    sched = greedy_run(engine, prompts, 8)
    for rid, p in prompts.items():
        assert sched.outputs(rid)[:8] == dense_greedy(engine.model, p, 8)
    if cuda_graphs:
        assert engine.graphs is not None and engine.graphs.graphs, "decode steps should have replayed a graph"


def test_triton_and_torch_attention_give_the_same_tokens_in_fp32() -> None:
    prompts = {f"t{i}": random_prompt(9 + 13 * i, seed=90 + i) for i in range(4)}
    outputs = {}
    for attention in ("torch", "triton"):
        engine = make_engine("tiny-opt", 96, 16, block_size=16, device="cuda", attention=attention)
        sched = greedy_run(engine, prompts, 10)
        outputs[attention] = {rid: sched.outputs(rid)[:10] for rid in prompts}
    assert outputs["torch"] == outputs["triton"]


class LogitsRecorder:
    """Keeps the logits each step sampled from, per request (rows follow the step's sampled ids)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[torch.Tensor] = []
        self.per_request: dict[str, list[torch.Tensor]] = {}
        original = engine.model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            logits = original(hidden)
            self.steps.append(logits.float().clone())
            return logits

        engine.model.compute_logits = record  # type: ignore[method-assign]

    def stop(self) -> None:
        del self.engine.model.compute_logits  # the class's method again

    def assign(self, result: StepResult) -> None:
        if result.sampled_token_ids:
            rows = self.steps.pop()
            for row, rid in enumerate(result.sampled_token_ids):
                self.per_request.setdefault(rid, []).append(rows[row])
        self.steps.clear()


def teacher_forced(model: torch.nn.Module, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """Logits [len(outputs), V] the model gives before each output token, on this exact sequence."""
    logits = dense_logits(model, prompt + outputs[:-1]).float()
    return logits[len(prompt) - 1 :]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_16_bit_paged_engine_tracks_the_dense_model_to_its_own_precision(dtype: str, cuda_graphs: bool) -> None:
    """Chunked prefill mixed with decodes, a swap out and back in, in bf16 / fp16. The engine's
    logits must be as close to the float32 model as the dense 16-bit model's are, and each
    greedy token must be the dense 16-bit model's (teacher forced on the engine's sequence),
    unless the two are tied within that same noise."""
    engine = make_engine("tiny-llama", 96, 32, block_size=16, device="cuda", dtype=dtype, cuda_graphs=cuda_graphs)
    recorder = LogitsRecorder(engine)
    prompts = {f"h{i}": random_prompt(11 + 17 * i, seed=30 + i) for i in range(4)}
    sched = MiniScheduler(engine)
    for rid, p in prompts.items():
        sched.add(rid, p)
    for step in range(80):
        active = [r for r in prompts if len(sched.outputs(r)) < 10]
        if not active:
            break
        held = set()
        if step == 8:
            sched.swap_out("h0")
            held = {"h0"}
        if step == 9:
            sched.swap_in("h0")
        recorder.assign(sched.step(budget_schedule(sched, [r for r in active if r not in held], 24, (8, 5, 16), step)))
    recorder.stop()
    reference = copy.deepcopy(engine.model).float()
    engine_err = dense_err = tie = 0.0
    exact = total = 0
    for rid, p in prompts.items():
        out = sched.outputs(rid)[:10]
        ref32 = teacher_forced(reference, p, out)
        dense16 = teacher_forced(engine.model, p, out)
        mine = torch.stack(recorder.per_request[rid][:10])
        engine_err = max(engine_err, float((mine - ref32).norm() / ref32.norm()))
        dense_err = max(dense_err, float((dense16 - ref32).norm() / ref32.norm()))
        tie = max(tie, float((dense16 - ref32).abs().max()))
        for j, token in enumerate(out):
            best = int(dense16[j].argmax())
            exact += token == best
            total += 1
            assert token == best or abs(float(ref32[j, token] - ref32[j, best])) <= 4 * tie + 1e-3, (rid, j)
    print(f"{dtype} graphs={cuda_graphs}: logits rel err engine {engine_err:.2e} vs dense {dense_err:.2e}; "
          f"greedy tokens equal to the dense model's {exact}/{total}")  # fmt: skip
    assert engine_err <= 2 * dense_err + 1e-4
    assert engine.graphs is None or engine.graphs.graphs or not cuda_graphs


def test_int8_swap_through_the_engine_on_cuda_keeps_kv_close_and_tokens_mostly_equal() -> None:
    engine = make_engine("tiny-llama", 32, 32, block_size=16, device="cuda", dtype="bfloat16")
    max_err, agree, total = int8_swap_round_trip(engine, bound_slack=2e-2)
    print(f"int8 swap on cuda: max |dequantized KV - KV| = {max_err:.4f}; greedy agreement {agree}/{total}")
    assert max_err < 0.06
    assert agree / total >= 0.75


def test_graph_padding_rows_touch_only_the_pad_block() -> None:
    engine = make_engine("tiny-llama", 40, 0, block_size=16, device="cuda", dtype="bfloat16")
    assert engine.graphs is not None and engine.cache is not None
    sched = MiniScheduler(engine)
    for i in range(3):  # three decodes: the graph of size 4 pads one row
        sched.add(f"p{i}", random_prompt(20, seed=i))
    sched.step({f"p{i}": 20 for i in range(3)})
    owned = {b for t in sched.kv.gpu_tables.values() for b in t}
    before = engine.cache.kv.clone()
    sched.step({f"p{i}": 1 for i in range(3)})
    assert 4 in engine.graphs.graphs
    changed = (engine.cache.kv != before).flatten(3).any(-1).any(0).any(0)  # per block
    touched = set(torch.nonzero(changed).flatten().tolist())
    assert touched <= owned | {engine.cache.pad_block}, touched - owned
