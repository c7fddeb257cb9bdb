"""`sluice profile`: measure a worker's step times, write the profile, fit the cost model to it.

    sluice profile --model tiny-llama [--device cuda] [--engine torch|vllm] [--quick | --grid gpu] --out profile.json
        worker_service.profiler.run_profile (real StepPlans through the engine, timed)
        -> WorkerProfile JSON -> scheduler_service.costmodel.fitted: MAPE and coefficients

This command is where the worker's measurements meet the scheduler's cost models; neither
service imports the other.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sluice.common.config import add_config_arguments, config_from, opt, subset
from sluice.contract.profile import WorkerProfile
from worker_service.engine_contract import EngineConfig


def report_fit(profile: WorkerProfile) -> float | None:
    """Fits the fitted cost model to the profile; prints and returns its step MAPE."""
    from scheduler_service.costmodel.fitted import FittedCostModel

    try:
        report = FittedCostModel(profile).fit_report()
    except ValueError as exc:
        print(f"fit failed: {exc}")
        return None
    coef = ", ".join(f"{k}={v:.3g}" for k, v in report.coefficients.items())
    swap = f"; swaps MAPE {report.swap_mape:.1%}" if report.swap_mape is not None else ""
    print(f"fitted cost model: step MAPE {report.mape:.1%} over {len(profile.steps)} samples{swap}")
    print(f"coefficients (s per unit): {coef}; roofline knee {report.knee} GEMM rows")
    if len(profile.steps) >= 8:
        held = FittedCostModel(profile).holdout()
        print(
            f"held out (every 4th step, fitted on the other {held.num_fitted}): median abs error {held.median:.1%}, "
            f"mean {held.mean:.1%}, p90 {held.p90:.1%}"
        )
    return report.mape


@dataclass
class ProfileConfig(EngineConfig):
    engine: str = opt("torch", "the engine to profile: torch (ours) or vllm (vLLM's model runner)")
    out: str = opt("profile.json", "WorkerProfile JSON to write")
    quick: bool = opt(False, "a small grid (about a minute on a CPU); same as --grid quick")
    grid: str | None = opt(None, "full (default), quick, or gpu (chunks 64-4096, decodes 1-256 x 512-8k)")
    setup: str = opt("auto", "contexts that decodes read: prefill, or declare them computed (auto: declare on CUDA)")
    gpu_memory_utilization: float = opt(0.9, "share of accelerator memory the profiled engine may use")
    threads: int = opt(0, "torch intra-op threads; 0: torch's default")
    sampling: str = opt("random", "how profiled requests sample: random (the API's default) or greedy")
    progress: bool = opt(True, "progress bar")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sluice profile", description="Measure this worker's step times.")
    add_config_arguments(p, ProfileConfig)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from worker_service.engines import engine_factory
    from worker_service.profiler import FULL_GRID, GPU_GRID, QUICK_GRID, SAMPLING, run_profile

    cfg = config_from(ProfileConfig, parse_args(argv))
    grids = {"quick": QUICK_GRID, "full": FULL_GRID, "gpu": GPU_GRID}
    if cfg.sampling not in SAMPLING:
        raise SystemExit(f"error: --sampling must be one of {', '.join(sorted(SAMPLING))}, got {cfg.sampling!r}")
    if cfg.grid not in (None, *grids) or cfg.setup not in ("auto", "prefill", "declare"):
        raise SystemExit(f"error: --grid must be quick, full or gpu and --setup auto, prefill or declare: {cfg}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    config = subset(EngineConfig, cfg)
    try:
        factory = engine_factory(cfg.engine)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    grid = grids[cfg.grid or ("quick" if cfg.quick else "full")]
    declare = None if cfg.setup == "auto" else cfg.setup == "declare"
    threads = torch.get_num_threads()
    print(f"profiling {config.model} ({cfg.engine} engine) on {config.device} ({threads} threads): {asdict(grid)}")
    start = time.perf_counter()
    engine = factory(config)
    util = cfg.gpu_memory_utilization
    profile, skipped = run_profile(
        engine, grid, util, progress=cfg.progress, sampling=cfg.sampling, declare_context=declare
    )
    profile.save(cfg.out)
    for line in skipped:
        print(f"skipped {line}")
    print(
        f"wrote {cfg.out}: {len(profile.steps)} step and {len(profile.swaps)} swap samples "
        f"in {time.perf_counter() - start:.1f} s"
    )
    report_fit(profile)
    return 0
