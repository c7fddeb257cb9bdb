"""Checks the CUDA path's logic on a CPU with Triton's interpreter (TRITON_INTERPRET=1).

    kernels     the GPU kernel tests (tests/unit/worker/test_paged_kernels.py) with device="cpu",
                in float32 and float16 (the interpreter's bfloat16 dot is wrong, so not bf16)
    engine      tiny-llama and tiny-opt through the engine's Triton path: greedy tokens vs the
                dense model, with chunked prefill, decodes and a swap out and back in
    graphs      the same through the decode-graph inputs (DecodeGraphs staging, padding rows,
                the pad block, static attention metadata), each "replay" run eagerly since a
                CPU has no CUDA graphs; KV outside the requests' blocks may change only in
                the pad block
    16bit       the 16-bit engine test of test_worker_gpu.py in float16, and a mutant (decodes
                that forget the newest key) that it must catch

It needs `pip install triton` beside the CPU torch (the project does not depend on it); the
real check is the GPU run of the same tests (`pytest -m gpu`).

    python tools/triton_cpu_check.py [kernels engine graphs 16bit]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit" / "worker")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language.core as tl_core  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_patch_lang = interpreter._patch_lang


def _patch_lang_numpy2(fn):  # type: ignore[no-untyped-def]
    # NOTE: the interpreter turns a one-element array into an int with int(array), which
    # NumPy 2 refuses for arrays of one dimension; `range(start, end)` over loaded scalars
    # needs it. Patched here only, after the interpreter's own patching.
    scope = _patch_lang(fn)
    tl_core.tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])
    return scope


interpreter._patch_lang = _patch_lang_numpy2

import test_paged_kernels as kernel_tests  # noqa: E402
import test_worker_gpu as gpu_tests  # noqa: E402
from worker_harness import MiniScheduler, budget_schedule, dense_greedy, make_engine, random_prompt  # noqa: E402

from kvstore import kernel_attention  # noqa: E402
from worker_service import engine as engine_module  # noqa: E402
from worker_service.cuda_graphs import DecodeGraphs  # noqa: E402
from worker_service.engine import LLMEngine  # noqa: E402


class EagerReplay:
    """Stands in for a captured graph: `replay` runs the captured call again into its output."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class CPUGraphs(DecodeGraphs):
    def _capture(self, size: int) -> tuple:  # type: ignore[override]
        attn = self._attention(size)
        ids, positions = self.static["ids"][:size], self.static["positions"][:size]

        def forward() -> torch.Tensor:
            return self.model(ids, positions, attn)

        replay = EagerReplay(forward, forward().clone())
        self.graphs[size] = (replay, replay.out)  # type: ignore[assignment]
        return replay, replay.out


def triton_engine(*args: object, graphs: bool, **config: object) -> LLMEngine:
    engine = make_engine(*args, **config)  # type: ignore[arg-type]
    engine.attention = "triton"  # NOTE: the engine refuses Triton without CUDA; forced here
    assert engine.cache is not None
    engine.graphs = CPUGraphs(engine.model, engine.cache, engine.max_model_len, 8) if graphs else None
    return engine


def check_kernels() -> None:
    for dtype in (torch.float32, torch.float16):
        for heads, kv_heads, dim in ((8, 2, 128), (4, 4, 64)):
            kernel_tests.test_decode_kernel_matches_float64_attention(dtype, heads, kv_heads, dim, device="cpu")
            kernel_tests.test_prefill_kernel_over_a_cached_prefix_matches_float64(dtype, heads, kv_heads, dim, "cpu")
            print(f"kernels: decode and prefill match float64 ({dtype}, {heads}/{kv_heads} heads, dim {dim})")
    for split in (256, 2048):
        kernel_tests.test_decode_kernel_is_right_for_any_split(split, device="cpu")
    print("kernels: every split gives the same answer")


def greedy_with_swap(engine: LLMEngine, num_output: int = 6) -> tuple[MiniScheduler, dict[str, list[int]], set[int]]:
    """Greedy decoding with a swap out and in; also returns every GPU block a request ever held."""
    prompts = {f"g{i}": random_prompt(5 + 6 * i, seed=70 + i) for i in range(3)}
    held: set[int] = set()
    sched = MiniScheduler(engine)
    for rid, p in prompts.items():
        sched.add(rid, p)
    for step in range(40):
        active = [r for r in prompts if len(sched.outputs(r)) < num_output]
        if not active:
            break
        if step == 4:
            sched.swap_out("g0")
            active = [r for r in active if r != "g0"]
        if step == 5:
            sched.swap_in("g0")
        sched.step(budget_schedule(sched, active, 7, (4, 3, 5), step))
        held |= {b for table in sched.kv.gpu_tables.values() for b in table}
    return sched, prompts, held


def check_engine(graphs: bool) -> None:
    for model in ("tiny-llama", "tiny-opt"):
        engine = triton_engine(model, graphs=graphs, num_gpu_blocks=64, num_cpu_blocks=16, block_size=4)
        assert engine.cache is not None
        before = engine.cache.kv.clone()
        sched, prompts, held = greedy_with_swap(engine)
        for rid, p in prompts.items():
            assert sched.outputs(rid)[:6] == dense_greedy(engine.model, p, 6), (model, rid)
        line = f"{'graphs' if graphs else 'engine'}: {model} greedy tokens equal the dense model's"
        if graphs:
            assert engine.graphs is not None and engine.graphs.graphs
            changed = (engine.cache.kv != before).flatten(3).any(-1).any(0).any(0)
            outside = set(torch.nonzero(changed).flatten().tolist()) - held
            assert outside <= {engine.cache.pad_block}, outside
            line += f"; sizes {sorted(engine.graphs.graphs)}; written outside the tables: {sorted(outside)} (pad)"
        print(line)


def check_16bit() -> None:
    original = gpu_tests.make_engine

    def make(*args: object, **config: object) -> LLMEngine:
        config.pop("device")
        return triton_engine(*args, graphs=bool(config.pop("cuda_graphs")), **config)  # type: ignore[arg-type]

    gpu_tests.make_engine = make
    try:
        for graphs in (False, True):
            gpu_tests.test_16_bit_paged_engine_tracks_the_dense_model_to_its_own_precision("float16", graphs)
        decode_columns = kernel_attention.decode_columns

        def forgets_newest_key(chunks, block_size):  # type: ignore[no-untyped-def]
            tables, lens, slots = decode_columns(chunks, block_size)
            return tables, np.maximum(lens - 1, 1).astype(np.int32), slots

        kernel_attention.decode_columns = engine_module.decode_columns = forgets_newest_key
        try:
            gpu_tests.test_16_bit_paged_engine_tracks_the_dense_model_to_its_own_precision("float16", False)
        except AssertionError:
            print("16bit: a decode kernel that forgets the newest key is caught")
        else:
            raise AssertionError("the 16-bit test let a broken decode through")
        finally:
            kernel_attention.decode_columns = engine_module.decode_columns = decode_columns
    finally:
        gpu_tests.make_engine = original


CHECKS: dict[str, Callable[[], None]] = {
    "kernels": check_kernels,
    "engine": lambda: check_engine(graphs=False),
    "graphs": lambda: check_engine(graphs=True),
    "16bit": check_16bit,
}


def main() -> int:
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
