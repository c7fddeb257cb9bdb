"""The fitted cost model on a worker profile: error on held-out steps, and the analytic and
Vidur-profile models priced at the very same shapes.

    profile (`sluice profile --grid gpu` JSON, or --proxy: the GPU grid priced by a model)
      -> FittedCostModel: fitted on 3 of every 4 step samples, priced on the 4th (held out)
      -> AnalyticCostModel / OperatorProfileCostModel ("profile", Vidur's H100 operator
         times) for the profiled preset on --hardware: priced on every step sample
      -> median / mean / p90 absolute relative error of each, per kind of step

`--proxy analytic|profile` stands in for a measured profile where no GPU is at hand: the
GPU grid's shapes priced by that model. It checks the fitted model's form (can its features
follow a GPU's step times?), not our worker: that takes a measured profile.

    python benchmarks/costmodel_gpu_fit.py --profile docs/results/data/gpu_h100_profile_llama-3-8b.json
    python benchmarks/costmodel_gpu_fit.py --proxy analytic --model llama-3-8b
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.costmodel.fitted import FittedCostModel
from sluice.contract.profile import BatchShape, StepSample, WorkerProfile
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table
from worker_service.profiler import GPU_GRID


def kind_of(shape: BatchShape) -> str:
    if shape.prefill_chunks and shape.num_decodes:
        return "mixed"
    return "prefill" if shape.prefill_chunks else "decode"


def grid_shapes(max_model_len: int, kv_tokens: int) -> list[BatchShape]:
    """The GPU grid's shapes that fit the model's length and `kv_tokens` of KV."""
    shapes = [BatchShape(prefill_chunks=[(c, p)]) for c, p in GPU_GRID.prefill if c + p <= max_model_len]
    for batch, ctx in ((b, x) for b in GPU_GRID.decode_batches for x in GPU_GRID.decode_contexts):
        if ctx <= max_model_len and batch * ctx <= kv_tokens:
            shape = BatchShape()
            for _ in range(batch):
                shape.add_decode(ctx)
            shapes.append(shape)
    for chunk, decodes, ctx in GPU_GRID.mixed:
        shape = BatchShape(prefill_chunks=[(chunk, 0)])
        for _ in range(decodes):
            shape.add_decode(ctx)
        shapes.append(shape)
    return shapes


def proxy_profile(kind: str, model: str, hardware: str) -> WorkerProfile:
    truth = build_cost_model(kind, model, hardware)
    kv_tokens = truth.num_kv_blocks(1)
    steps = [StepSample(s, truth.iteration_time(s)) for s in grid_shapes(truth.model.max_model_len, kv_tokens)]
    return WorkerProfile(truth.model, f"{kind} model on {hardware}", "bfloat16", 16, "proxy", steps, [])


def stats(errors: Sequence[float]) -> dict[str, str]:
    a = np.abs(np.asarray(errors))
    pct = "{:.1%}"
    cells = {"median abs error": np.median(a), "mean": a.mean(), "p90": np.percentile(a, 90)}
    return {k: pct.format(v) for k, v in cells.items()} | {"n": str(len(a))}


def rows_for(name: str, errors: list[tuple[str, float]]) -> list[dict[str, str]]:
    out = [{"model": name, "steps": "all", **stats([e for _, e in errors])}]
    for kind in ("prefill", "decode", "mixed"):
        part = [e for k, e in errors if k == kind]
        if part:
            out.append({"model": name, "steps": kind, **stats(part)})
    return out


def priced_errors(model: CostModel, steps: list[StepSample]) -> list[tuple[str, float]]:
    return [(kind_of(s.shape), (model.iteration_time(s.shape) - s.time_s) / s.time_s) for s in steps]


def report(profile: WorkerProfile, hardware: str, every: int) -> str:
    fitted = FittedCostModel(profile)
    held = fitted.holdout(every)
    held_steps = profile.steps[::every]
    lines = [
        f"profile: {profile.model.name} on {profile.device}, {len(profile.steps)} step samples; fitted knee "
        f"{fitted.knee} GEMM rows; in-sample MAPE {fitted.fit_report().mape:.1%}",
        "",
    ]
    rows = rows_for(
        f"fitted (on {held.num_fitted}, held out)",
        [(kind_of(s.shape), e) for s, e in zip(held_steps, held.relative_errors, strict=True)],
    )
    preset = profile.model.name.partition("@")[0]
    for kind in ("analytic", "profile"):
        try:
            model = build_cost_model(kind, preset, hardware)
        except (KeyError, ValueError) as exc:
            missing = {"median abs error": f"not available: {exc}", "mean": "", "p90": "", "n": ""}
            rows.append({"model": kind, "steps": "-", **missing})
            continue
        rows += rows_for(f"{kind} ({hardware})", priced_errors(model, profile.steps))
    return "\n".join([*lines, format_table(rows)])


def main(argv: Sequence[str] | None = None) -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--profile", help="a `sluice profile` JSON")
    p.add_argument("--proxy", choices=("analytic", "profile"), help="price the GPU grid with this model instead")
    p.add_argument("--model", default="llama-3-8b", help="preset (with --proxy)")
    p.add_argument("--hardware", default="h100-80g")
    p.add_argument("--every", type=int, default=4, help="hold out every n-th step sample")
    args = p.parse_args(argv)
    if (args.profile is None) == (args.proxy is None):
        p.error("give exactly one of --profile and --proxy")
    profile = WorkerProfile.load(args.profile) if args.profile else proxy_profile(args.proxy, args.model, args.hardware)
    print(report(profile, args.hardware, args.every))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
