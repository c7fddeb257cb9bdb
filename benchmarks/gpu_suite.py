"""The worker on a GPU, measured in one run: ceilings, kernels, decode, prefill, swaps, then the
worker benchmark and `sluice profile` as subprocesses; a short table last, everything as JSON.

    roofline    device-to-device copy GB/s (read + write), bf16 GEMM TFLOP/s (8192^3 and the
                8B model's prefill shapes), pinned and pageable host<->device GB/s
    tests       pytest of the CUDA tests (kernels vs float64, engine vs dense, graphs, swaps)
    kernels     paged decode / prefill attention alone: Triton vs the torch path (gather + SDPA)
    decode      engine steps of B decodes at context C (real StepPlans, declared contexts) per
                attention config; bytes (weights read + KV read and written) / step time, as a
                share of the measured copy bandwidth and of the datasheet's
    prefill     engine steps of one chunk over a cached prefix; FLOPs / time vs GEMM peak
    swap        swap-out / swap-in GB/s (plain and int8) vs pinned copies; a decode step with
                a swap-out (and with a swap-in) of another request against each alone
    swap_trace  that decode step with a swap-out under torch.profiler, as a Chrome trace
    throughput  benchmarks/worker_throughput.py at the model's real shape (subprocess)
    profile     `sluice profile --grid gpu` for each --profile-models (subprocess)
    fidelity    benchmarks/fidelity.py: live scheduler + one GPU worker vs the simulator priced by
                this run's profile of --model (subprocess)

    python benchmarks/gpu_suite.py --out OUT [--phases roofline,decode,...] [--model llama-3-8b]

Every phase writes its results into OUT/suite.json as soon as it ends, so a run cut short
still returns what it measured. Decode and prefill need no setup prefills: requests arrive
with their contexts declared computed (`PlanDriver(declare_context=True)`), which leaves
every timing unchanged (attention reads each cached position whatever it holds).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind
from sluice_bench.options import benchmark_parser
from sluice_bench.report import write_json
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.profiler import PlanDriver

ROOT = Path(__file__).resolve().parents[1]
SPEC_HBM_BYTES_S = 3.35e12  # H100 SXM5 80 GB datasheet
SPEC_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, same datasheet
CONFIGS = {  # name -> (attention, cuda graphs)
    "torch-eager": ("torch", False),
    "triton-eager": ("triton", False),
    "triton-graphs": ("triton", True),
}
DECODE_POINTS = (
    (1, 512), (1, 2048), (1, 8192), (8, 2048), (16, 2048), (32, 2048), (32, 8192), (64, 512), (64, 2048),
    (64, 4096), (128, 1024), (128, 2048), (256, 512), (256, 1024),
)  # fmt: skip
PREFILL_POINTS = ((512, 0), (1024, 0), (2048, 0), (4096, 0), (512, 1536), (2048, 2048), (1024, 6144))


def sync() -> None:
    """Waits for the device (a no-op on a CPU, where the suite's CPU phases are rehearsed)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10) -> float:
    """Median device time of fn() in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---------------------------------------------------------------------------------- phases


def phase_env(args: argparse.Namespace, state: dict) -> dict:
    import google.protobuf
    import grpc

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        import triton

        props = torch.cuda.get_device_properties(0)
        info |= {"triton": triton.__version__, "device": props.name, "sms": props.multi_processor_count}
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu",
             "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip()
    return info


def phase_roofline(args: argparse.Namespace, state: dict) -> dict:
    out: dict[str, Any] = {}
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    out["copy_gb_s"] = 2 * n / median_ms(lambda: dst.copy_(src)) / 1e6
    src = dst = torch.empty(0)
    gemms = {"8192^3": (8192, 8192, 8192), "qkv 2048x4096x6144": (2048, 4096, 6144),
             "gate_up 2048x4096x28672": (2048, 4096, 28672), "down 2048x14336x4096": (2048, 14336, 4096)}  # fmt: skip
    for name, (m, k, nn) in gemms.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, nn, device="cuda", dtype=torch.bfloat16)
        out[f"gemm {name} tflop_s"] = 2 * m * k * nn / median_ms(lambda a=a, b=b: a @ b) / 1e9
    size = 1 << 30
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    for kind, host in (("pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
                       ("pageable", torch.empty(size, dtype=torch.uint8))):  # fmt: skip
        out[f"{kind} h2d_gb_s"] = size / median_ms(lambda h=host: dev.copy_(h, non_blocking=True), 1, 5) / 1e6
        out[f"{kind} d2h_gb_s"] = size / median_ms(lambda h=host: h.copy_(dev, non_blocking=True), 1, 5) / 1e6
    state["roofline"] = out
    return out


def phase_tests(args: argparse.Namespace, state: dict) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "300", "-s",
           "tests/unit/worker"]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=args.tests_timeout_s)
    except subprocess.TimeoutExpired as exc:
        print(str(exc.stdout or "")[-8000:], flush=True)
        return {"rc": "timeout", "seconds": args.tests_timeout_s}
    print(proc.stdout[-8000:], proc.stderr[-3000:], flush=True)
    lines = proc.stdout.splitlines()
    summary = [line for line in lines if " passed" in line or " failed" in line or "error" in line]
    notes = [line for line in lines if "logits rel err" in line or "int8 swap" in line]
    return {"rc": proc.returncode, "summary": summary[-1:], "seconds": time.perf_counter() - start, "notes": notes}


def decode_kernel_point(batch: int, ctx: int, copy_bw: float) -> dict:
    """Paged decode attention alone (llama-3-8b heads), Triton vs gather + SDPA, on random KV."""
    from kvstore import paged_kernels
    from kvstore.paged import sdpa

    heads, kv_heads, dim, page = 32, 8, 128, 16
    blocks = batch * ctx // page
    k = torch.randn(blocks + 1, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).reshape(batch, ctx // page)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    launch = paged_kernels.decode_launch(tables, lens, None, ctx, kv_heads)
    mask = torch.ones(batch, 1, 1, ctx, dtype=torch.bool, device="cuda")
    long_tables = tables.long()

    def torch_path() -> torch.Tensor:
        keys = k[long_tables].view(batch, -1, kv_heads, dim).transpose(1, 2)
        values = v[long_tables].view(batch, -1, kv_heads, dim).transpose(1, 2)
        return sdpa(q.unsqueeze(2), keys, values, mask, causal=False)

    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
    triton_ms = median_ms(lambda: paged_kernels.paged_decode(q, k, v, launch, o))
    torch_ms = median_ms(torch_path)
    return {
        "triton_ms": triton_ms,
        "torch_ms": torch_ms,
        "kv_mb": kv_bytes / 1e6,
        "triton_of_copy_bw": kv_bytes / (triton_ms / 1e3) / copy_bw,
        "torch_of_copy_bw": kv_bytes / (torch_ms / 1e3) / copy_bw,
        "split": launch.split,
    }


def prefill_kernel_point(chunk: int, prefix: int) -> dict:
    """Paged prefill attention of one chunk over a cached prefix, Triton vs gather + SDPA."""
    from kvstore import paged_kernels
    from kvstore.paged import causal_chunk, sdpa

    heads, kv_heads, dim, page = 32, 8, 128, 16
    ctx = chunk + prefix
    blocks = -(-ctx // page)
    k = torch.randn(blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device="cuda").to(torch.int32)[None]
    q = torch.randn(chunk, heads, dim, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    launch = paged_kernels.prefill_launch([(0, prefix, chunk)], table)
    qpos = torch.arange(prefix, ctx, device="cuda")[:, None]
    mask = (torch.arange(ctx, device="cuda")[None, :] <= qpos)[None, None]

    def torch_path() -> torch.Tensor:
        keys = k[table[0].long()].view(-1, kv_heads, dim)[:ctx]
        values = v[table[0].long()].view(-1, kv_heads, dim)[:ctx]
        if prefix == 0:
            return causal_chunk(q, keys, values)
        return sdpa(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, False)

    flops = 4 * heads * dim * (chunk * prefix + chunk * (chunk + 1) / 2)
    triton_ms = median_ms(lambda: paged_kernels.paged_prefill(q, k, v, launch, o))
    torch_ms = median_ms(torch_path)
    return {
        "triton_ms": triton_ms,
        "torch_ms": torch_ms,
        "triton_tflop_s": flops / triton_ms / 1e9,
        "torch_tflop_s": flops / torch_ms / 1e9,
    }


def phase_kernels(args: argparse.Namespace, state: dict) -> dict:
    copy_bw = state.get("roofline", {}).get("copy_gb_s", SPEC_HBM_BYTES_S / 1e9) * 1e9
    out: dict[str, Any] = {}
    for batch, ctx in ((64, 2048), (8, 8192), (256, 1024), (1, 8192)):
        out[f"decode B={batch} ctx={ctx}"] = decode_kernel_point(batch, ctx, copy_bw)
        torch.cuda.empty_cache()
    for chunk, prefix in ((2048, 0), (512, 1536), (2048, 2048)):
        out[f"prefill {chunk}+{prefix}"] = prefill_kernel_point(chunk, prefix)
    return out


def weight_read_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step reads of the weights: all but the embedding table (B rows of it)."""
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    embed = engine.model.embed_weight()
    tied = engine.model_config.tie_word_embeddings
    return total if tied else total - embed.numel() * embed.element_size()


def kv_bytes_per_token(engine: LLMEngine) -> int:
    return engine.spec.bytes_per_block // engine.spec.block_size


def decode_point(driver: PlanDriver, batch: int, ctx: int, warmup: int = 2, repeats: int = 5) -> dict:
    rids = driver.prefill(batch, ctx, ctx, ctx + warmup + repeats + 1)
    runs = []
    for i in range(warmup + repeats):
        elapsed, result = driver.step(dict.fromkeys(rids, 1))
        if i >= warmup:
            runs.append((elapsed, result.forward_s, result.sample_s, result.prepare_s))
    driver.release(rids)
    med = [statistics.median(r[j] for r in runs) for j in range(4)]
    return {"step_ms": med[0] * 1e3, "forward_ms": med[1] * 1e3, "sample_ms": med[2] * 1e3, "prepare_ms": med[3] * 1e3}


def build_engine(args: argparse.Namespace, state: dict) -> LLMEngine:
    if "engine" not in state:
        config = EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype)
        state["engine"] = LLMEngine(config)
    return state["engine"]


def driver_for(engine: LLMEngine, config: str, num_gpu_blocks: int, num_cpu_blocks: int) -> PlanDriver:
    attention, graphs = CONFIGS[config]
    engine.config.attention, engine.config.cuda_graphs = attention, graphs
    return PlanDriver(engine, num_gpu_blocks, num_cpu_blocks, sampling="random", declare_context=True)


def configs_here(args: argparse.Namespace) -> list[str]:
    return [c for c in args.configs if args.device == "cuda" or CONFIGS[c][0] == "torch"]


def phase_decode(args: argparse.Namespace, state: dict) -> dict:
    engine = build_engine(args, state)
    per_token = kv_bytes_per_token(engine)
    blocks = max(b * -(-(c + 16) // engine.spec.block_size) for b, c in args.decode_points) + 8
    weights = weight_read_bytes(engine)
    copy_bw = state.get("roofline", {}).get("copy_gb_s", SPEC_HBM_BYTES_S / 1e9) * 1e9
    out: dict[str, Any] = {"weights_gb": weights / 1e9, "kv_bytes_per_token": per_token}
    for config in configs_here(args):
        driver = driver_for(engine, config, blocks, 0)
        for batch, ctx in args.decode_points:
            if ctx + 16 > engine.max_model_len or state_expired(args, state):
                continue
            try:
                point = decode_point(driver, batch, ctx)
            except torch.cuda.OutOfMemoryError as exc:
                out[f"{config} B={batch} ctx={ctx}"] = {"error": f"out of memory: {exc}"[:200]}
                driver.reset()
                torch.cuda.empty_cache()
                continue
            moved = weights + batch * (ctx + 4) * per_token  # the median step reads ctx + 4 tokens each
            point |= {
                "gb": moved / 1e9,
                "of_copy_bw": moved / (point["step_ms"] / 1e3) / copy_bw,
                "of_spec_bw": moved / (point["step_ms"] / 1e3) / SPEC_HBM_BYTES_S,
                "forward_of_copy_bw": moved / (point["forward_ms"] / 1e3) / copy_bw,
            }
            out[f"{config} B={batch} ctx={ctx}"] = point
            print(f"decode {config} B={batch} ctx={ctx}: {point['step_ms']:.2f} ms step, {point['forward_ms']:.2f} ms "
                  f"forward, {point['of_copy_bw']:.0%} of copy bandwidth", flush=True)  # fmt: skip
    return out


def prefill_flops(engine: LLMEngine, chunk: int, prefix: int) -> float:
    c = engine.model_config
    params = sum(p.numel() for p in engine.model.parameters())
    # every weight but the embedding table and the LM head (which sees one row): GEMM rows x 2
    matmul = params - (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size
    attention = 4 * c.num_layers * c.q_size * (chunk * prefix + chunk * (chunk + 1) / 2)
    return 2 * chunk * matmul + attention + 2 * c.hidden_size * c.vocab_size


def phase_prefill(args: argparse.Namespace, state: dict) -> dict:
    engine = build_engine(args, state)
    blocks = max(-(-(c + p + 16) // engine.spec.block_size) for c, p in args.prefill_points) + 8
    gemm_peak = state.get("roofline", {}).get("gemm 8192^3 tflop_s", SPEC_BF16_FLOPS / 1e12) * 1e12
    out: dict[str, Any] = {}
    for config in [c for c in configs_here(args) if c != "triton-graphs"]:
        driver = driver_for(engine, config, blocks, 0)
        for chunk, prefix in args.prefill_points:
            if chunk + prefix > engine.max_model_len or state_expired(args, state):
                continue
            times = []
            for i in range(5):
                (rid,) = driver.prefill(1, prefix + chunk, prefix, prefix + chunk)
                elapsed, result = driver.step({rid: chunk})
                driver.release([rid])
                if i >= 2:
                    times.append((elapsed, result.forward_s))
            step_s, forward_s = (statistics.median(t[j] for t in times) for j in range(2))
            flops = prefill_flops(engine, chunk, prefix)
            out[f"{config} {chunk}+{prefix}"] = {
                "step_ms": step_s * 1e3, "forward_ms": forward_s * 1e3, "tflop": flops / 1e12,
                "of_gemm_peak": flops / step_s / gemm_peak, "of_spec_peak": flops / step_s / SPEC_BF16_FLOPS,
                "tokens_s": chunk / step_s,
            }  # fmt: skip
            rate = flops / step_s / 1e12
            print(f"prefill {config} {chunk}+{prefix}: {step_s * 1e3:.1f} ms, {rate:.0f} TFLOP/s", flush=True)
    return out


def swap_round(driver: PlanDriver, rid: str, scheduled: dict[str, int] | None = None) -> tuple[float, float]:
    """One step with a swap-out of `rid` (plus `scheduled` decodes); returns (step wall s, wall s
    until the swap stream drained too); then swaps it back in, untimed."""
    gpu = tuple(driver.tables[rid])
    cpu = tuple(driver.take(driver.free_cpu, len(gpu)))
    start = time.perf_counter()
    step_s, _ = driver.step(scheduled or {}, moves=[KVMove(KVMoveKind.SWAP_OUT, rid, gpu, cpu, False)])
    sync()
    drained = time.perf_counter() - start
    back = CachedRequestData((rid,), (gpu,), (True,), (driver.computed[rid],))
    driver.step({}, moves=[KVMove(KVMoveKind.SWAP_IN, rid, cpu, gpu)], cached=back)
    driver.free_cpu.extend(cpu)
    return step_s, drained


def cache_swap_gb_s(engine: LLMEngine, num_blocks: int, int8: bool) -> dict:
    """Swap-out and swap-in of `num_blocks` through the cache alone, timed to a device sync."""
    cache = engine.cache
    assert cache is not None
    gpu, cpu = list(range(num_blocks)), list(range(num_blocks))
    outs, ins, moved = [], [], 0
    for i in range(6):
        sync()
        t0 = time.perf_counter()
        with cache.swapping():
            moved = cache.swap_out(gpu, cpu, int8)
        sync()
        t1 = time.perf_counter()
        with cache.swapping():
            cache.swap_in(cpu, gpu)
        sync()
        if i:
            outs.append(t1 - t0)
            ins.append(time.perf_counter() - t1)
    raw = num_blocks * engine.spec.bytes_per_block
    t_out, t_in = statistics.median(outs), statistics.median(ins)
    return {"bytes_moved": moved, "out_ms": t_out * 1e3, "in_ms": t_in * 1e3,
            "out_gb_s": moved / t_out / 1e9, "in_gb_s": moved / t_in / 1e9,
            "out_kv_gb_s": raw / t_out / 1e9, "in_kv_gb_s": raw / t_in / 1e9}  # fmt: skip


def swap_costs(engine: LLMEngine, cache_runs: dict[str, Any], pinned: dict[str, float]) -> dict:
    """The swap costs the worker pays, in the simulator's terms: a straight line through the
    plain swap times over the block counts (time = fixed + per block x n). `--swap-stall-s` is
    the fixed part; `--swap-copy-overhead-s` (per KV copy call, 2 x layers calls per block) is
    what a block costs beyond its bytes at the pinned copy rate the cost model already prices."""
    layers = engine.model_config.num_layers
    bpb = engine.spec.bytes_per_block
    out: dict[str, Any] = {"bytes_per_block": bpb}
    for way, bw_key in (("out", "pinned d2h_gb_s"), ("in", "pinned h2d_gb_s")):
        pts = [(int(k.split()[1]), r[f"{way}_ms"] / 1e3) for k, r in cache_runs.items() if k.endswith("blocks")]
        if len(pts) < 2:
            continue
        n_mean = statistics.fmean(n for n, _ in pts)
        t_mean = statistics.fmean(t for _, t in pts)
        slope = sum((n - n_mean) * (t - t_mean) for n, t in pts) / sum((n - n_mean) ** 2 for n, _ in pts)
        fixed = t_mean - slope * n_mean
        row = {"fixed_ms": fixed * 1e3, "per_block_us": slope * 1e6, "line_gb_s": bpb / slope / 1e9}
        if bw_key in pinned:
            beyond = slope - bpb / (pinned[bw_key] * 1e9)
            row |= {"beyond_pinned_per_block_us": beyond * 1e6, "swap_stall_s": max(0.0, fixed),
                    "swap_copy_overhead_s": max(0.0, beyond) / (2 * layers)}  # fmt: skip
        out[way] = row
    return out


def phase_swap(args: argparse.Namespace, state: dict) -> dict:
    engine = build_engine(args, state)
    bs = engine.spec.block_size
    batch, ctx, victim_blocks = args.overlap
    gpu_blocks = batch * -(-(ctx + 64) // bs) + victim_blocks + max(args.swap_blocks) + 8
    driver = driver_for(engine, args.configs[-1], gpu_blocks, max(victim_blocks, max(args.swap_blocks)))
    out: dict[str, Any] = {}
    pinned = state.get("roofline", {})
    for n in args.swap_blocks:
        for int8 in (False, True):
            r = cache_swap_gb_s(engine, n, int8)
            if pinned:
                r["out_of_pinned"] = r["out_gb_s"] / pinned["pinned d2h_gb_s"]
                r["in_of_pinned"] = r["in_gb_s"] / pinned["pinned h2d_gb_s"]
            out[f"cache {n} blocks{' int8' if int8 else ''}"] = r
    out["costs"] = swap_costs(engine, out, pinned)
    rids = driver.prefill(batch, ctx, ctx, ctx + 64)
    (victim,) = driver.prefill(1, victim_blocks * bs, victim_blocks * bs, victim_blocks * bs)
    decodes = dict.fromkeys(rids, 1)

    def decode_alone() -> tuple[float, float]:
        start = time.perf_counter()
        step_s, _ = driver.step(decodes)
        sync()
        return step_s, time.perf_counter() - start

    runs: dict[str, list[tuple[float, float]]] = {"decode": [], "swap_out": [], "both_out": []}
    for i in range(7):
        runs["decode"].append(decode_alone())
        runs["swap_out"].append(swap_round(driver, victim))
        runs["both_out"].append(swap_round(driver, victim, decodes))
        if i < 2:
            for k in runs:
                runs[k].pop()
    med = {k: [statistics.median(r[j] for r in v) * 1e3 for j in range(2)] for k, v in runs.items()}
    t_d, t_s, t_both = med["decode"][1], med["swap_out"][1], med["both_out"][1]
    out["overlap"] = {
        "decode_ms": t_d, "swap_out_ms": t_s, "both_ms": t_both, "both_step_ms": med["both_out"][0],
        "hidden_share_of_shorter": (t_d + t_s - t_both) / min(t_d, t_s),
        "swap_mb": victim_blocks * engine.spec.bytes_per_block / 1e6,
    }  # fmt: skip
    driver.release([*rids, victim])
    return out


def phase_swap_trace(args: argparse.Namespace, state: dict) -> dict:
    """One decode step with a swap-out beside it under torch.profiler (CPU and CUDA), the trace
    written to OUT/swap_trace.json: which stream waited for what when the two did not overlap."""
    from torch.profiler import ProfilerActivity, profile

    engine = build_engine(args, state)
    bs = engine.spec.block_size
    batch, ctx, victim_blocks = args.overlap
    driver = driver_for(engine, args.configs[-1], batch * -(-(ctx + 64) // bs) + victim_blocks + 8, victim_blocks)
    rids = driver.prefill(batch, ctx, ctx, ctx + 64)
    (victim,) = driver.prefill(1, victim_blocks * bs, victim_blocks * bs, victim_blocks * bs)
    decodes = dict.fromkeys(rids, 1)
    for _ in range(2):
        swap_round(driver, victim, decodes)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step_s, drained_s = swap_round(driver, victim, decodes)
        sync()
    path = Path(args.out) / "swap_trace.json"
    prof.export_chrome_trace(str(path))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50)
    print(table, flush=True)
    driver.release([*rids, victim])
    return {"step_ms": step_s * 1e3, "drained_ms": drained_s * 1e3, "trace": str(path)}


def phase_breakdown(args: argparse.Namespace, state: dict) -> dict:
    """Where the device time of one eager step goes (torch.profiler, top kernels by CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    engine = build_engine(args, state)
    batch, ctx = 64, 2048
    blocks = batch * -(-(ctx + 32) // engine.spec.block_size) + 2048 // engine.spec.block_size + 8
    driver = driver_for(engine, "triton-eager", blocks, 0)
    out: dict[str, Any] = {}
    rids = driver.prefill(batch, ctx, ctx, ctx + 32)
    for _ in range(3):
        driver.step(dict.fromkeys(rids, 1))
    (pre,) = driver.prefill(1, 2048, 0, 2048)
    steps = {
        "decode 64x2048": lambda: driver.step(dict.fromkeys(rids, 1)),
        "prefill 2048": lambda: driver.step({pre: 2048}),
    }
    for name, run in steps.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        print(f"-- {name}\n{table}", flush=True)
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
        out[name] = {e.key[:80]: round(e.device_time_total / 1e3, 3) for e in events}
    driver.release([*rids, pre])
    return out


def run_subprocess(cmd: list[str], timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {"rc": "timeout", "seconds": timeout_s, "tail": str(exc.stdout or "")[-3000:]}
    print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
    return {"rc": proc.returncode, "seconds": time.perf_counter() - start, "tail": proc.stdout[-4000:]}


def free_engine(state: dict) -> None:
    state.pop("engine", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def phase_throughput(args: argparse.Namespace, state: dict) -> dict:
    free_engine(state)
    md = Path(args.out) / "throughput.md"
    cmd = [sys.executable, "benchmarks/worker_throughput.py", "--model", args.model, "--device", args.device,
           "--threads", "0", "--repeats", "1", "--no-progress", "--markdown", str(md),
           *args.throughput_args]  # fmt: skip
    return run_subprocess(cmd, max(30.0, remaining(args, state) - 5))


def phase_profile(args: argparse.Namespace, state: dict) -> dict:
    free_engine(state)
    out = {}
    for model in args.profile_models:
        path = Path(args.out) / f"profile-{model}.json"
        cmd = [sys.executable, "-m", "services.cli", "profile", "--model", model, "--device", args.device,
               "--grid", args.profile_grid, "--no-progress", "--out", str(path), *args.profile_args]  # fmt: skip
        out[model] = run_subprocess(cmd, max(30.0, remaining(args, state) - 5))
    return out


def phase_fidelity(args: argparse.Namespace, state: dict) -> dict:
    """Live (scheduler + one GPU worker) against the simulator priced by this run's profile."""
    free_engine(state)
    profile = Path(args.out) / f"profile-{args.model}.json"
    if not profile.exists():
        return {"skipped": f"no profile of {args.model} from this run"}
    cmd = [sys.executable, "benchmarks/fidelity.py", "--device", args.device, "--model", args.model,
           "--profile", str(profile), "--json", str(Path(args.out) / "fidelity.json"), *args.fidelity_args]  # fmt: skip
    return run_subprocess(cmd, max(30.0, remaining(args, state) - 5))


PHASES: dict[str, Callable[[argparse.Namespace, dict], dict]] = {
    "env": phase_env,
    "roofline": phase_roofline,
    "tests": phase_tests,
    "kernels": phase_kernels,
    "decode": phase_decode,
    "prefill": phase_prefill,
    "swap": phase_swap,
    "swap_trace": phase_swap_trace,
    "breakdown": phase_breakdown,
    "throughput": phase_throughput,
    "profile": phase_profile,
    "fidelity": phase_fidelity,
}


def remaining(args: argparse.Namespace, state: dict) -> float:
    return args.deadline_s - (time.perf_counter() - state["t0"])


def state_expired(args: argparse.Namespace, state: dict) -> bool:
    return remaining(args, state) < 20


# ---------------------------------------------------------------------------------- report


def summary(results: dict) -> str:
    lines = ["", "== summary =="]
    for phase, res in results.items():
        if not isinstance(res, dict):
            continue
        if "error" in res:
            lines.append(f"{phase}: ERROR {res['error'].splitlines()[-1]}")
            continue
        if phase in ("decode", "prefill", "kernels", "swap"):
            for key, row in res.items():
                if isinstance(row, dict):
                    cells = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                    lines.append(f"{phase} {key}: {cells}")
        elif phase in ("env", "roofline"):
            cells = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
            lines.append(f"{phase}: {cells}")
        elif phase == "profile":
            for model, run in res.items():
                lines.append(f"{phase} {model}: rc={run.get('rc')}, seconds={run.get('seconds')}")
        else:
            cells = ", ".join(f"{k}={res[k]}" for k in ("rc", "summary", "seconds", "notes", "skipped") if k in res)
            lines.append(f"{phase}: {cells}")
    return "\n".join(lines)


def parse_points(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in p.split("x")) for p in text.split(",") if p]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-suite-out"))
    p.add_argument("--phases", default="env,roofline,tests,kernels,decode,prefill,swap,breakdown,throughput,profile")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default="torch-eager,triton-eager,triton-graphs")
    p.add_argument("--decode-points", default=",".join(f"{b}x{c}" for b, c in DECODE_POINTS))
    p.add_argument("--prefill-points", default=",".join(f"{c}x{p}" for c, p in PREFILL_POINTS))
    p.add_argument("--swap-blocks", default="16,64,128,256,512")
    p.add_argument("--overlap", default="64x2048x256", help="decodes x context x blocks swapped beside them")
    p.add_argument("--profile-models", default="llama-3-8b,llama-2-7b")
    p.add_argument("--profile-grid", default="gpu")
    # Headroom for the int8 swap's float32 temporaries (a 512-block int8 swap-out of an 8B model
    # needs about 6 GiB beside the cache; at 0.9 it ran out of memory on an 80 GB H100).
    p.add_argument("--profile-args", default="--gpu-memory-utilization 0.8", help="extra `sluice profile` arguments")
    p.add_argument("--throughput-args", default="", help="extra arguments for worker_throughput.py, space separated")
    p.add_argument(
        "--fidelity-args",
        default="--prompt-scale 1 --max-prompt 4096 --max-output 512 --max-model-len 8192 --num-gpu-blocks 16384 "
        "--max-num-seqs 128 --max-num-batched-tokens 2048 --rate 4 --target 0.10",
        help="extra arguments for fidelity.py, space separated",
    )
    p.add_argument("--deadline-s", type=float, default=540.0, help="skip what would start after this many seconds")
    p.add_argument("--tests-timeout-s", type=float, default=200.0)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    args.configs = [x for x in args.configs.split(",") if x]
    args.decode_points = parse_points(args.decode_points)
    args.prefill_points = parse_points(args.prefill_points)
    args.swap_blocks = [int(x) for x in args.swap_blocks.split(",")]
    args.overlap = parse_points(args.overlap)[0]
    args.profile_models = [x for x in args.profile_models.split(",") if x]
    args.throughput_args = args.throughput_args.split()
    args.fidelity_args = args.fidelity_args.split()
    args.profile_args = args.profile_args.split()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"t0": time.perf_counter()}
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    for phase in args.phases:
        if state_expired(args, state):
            results[phase] = {"skipped": f"deadline ({args.deadline_s} s)"}
            continue
        start = time.perf_counter()
        print(f"== {phase} ({start - state['t0']:.0f} s in)", flush=True)
        try:
            results[phase] = PHASES[phase](args, state)
        except Exception:
            results[phase] = {"error": traceback.format_exc()}
            print(results[phase]["error"], flush=True)
        results.setdefault("seconds", {})[phase] = time.perf_counter() - start
        write_json(results, Path(args.out) / "suite.json", indent=1, quiet=True)
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
