"""Calibration of the cost models against each other and against published points.

Prints markdown tables (docs/results/costmodel_calibration.md) and draws
docs/results/data/costmodel_calibration.png:

1. non-attention forward time vs the measured orientation table of profiles/README.md
   (Vidur mlp.csv sums) for several model / GPU / TP combinations;
2. attention vs the legacy A100 attention grid (README orientation values);
3. whole iterations, analytic vs operator profile, on mixed shapes;
4. AccelGen (section 4.2): OPT-13B on A100 saturates near forward size 768;
5. Sarathi-Serve Fig. 3: decode throughput grows with batch size, prefill saturates at once.

Usage: python benchmarks/costmodel_calibration.py [--plot docs/results/data/costmodel_calibration.png]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.costmodel.pivot import pivot_forward_size, throughput_curve
from sluice.contract.profile import BatchShape
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table

TOKENS = (1, 64, 256, 512, 2048, 4096)
README_MS = {
    ("a100-80g", "llama-2-7b", 1): (9.3, 9.7, 17.8, 33.4, 133.5, 261.5),
    ("a100-80g", "llama-2-7b", 2): (5.0, 5.3, 10.6, 18.0, 66.4, 129.7),
    ("a100-80g", "llama-3-8b", 1): (9.7, 11.2, 19.5, 34.6, 141.8, 272.9),
    ("a100-80g", "codellama-34b", 2): (22.3, 24.0, 43.0, 84.1, 312.1, 617.0),
    ("a100-80g", "llama-2-70b", 4): (24.9, 26.8, 51.0, 89.3, 334.8, 633.0),
    ("a100-80g", "llama-2-70b", 8): (14.2, 15.2, 30.4, 51.8, 183.2, 336.9),
    ("h100-80g", "llama-2-7b", 1): (5.6, 5.9, 9.2, 12.0, 40.5, 82.9),
    ("h100-80g", "codellama-34b", 2): (12.9, 13.9, 18.0, 29.3, 103.4, 212.2),
    ("h100-80g", "llama-2-70b", 4): (14.3, 15.3, 19.2, 30.0, 113.6, 221.8),
    ("h100-80g", "llama-2-70b", 8): (8.4, 9.0, 11.5, 17.7, 63.6, 123.0),
}
# README "orientation values" of the legacy grid: ms per layer, 32 q / 4 KV heads per GPU.
LEGACY_DECODE_MS = {(1, 1024): 0.017, (8, 2048): 0.046, (32, 1024): 0.064, (64, 2048): 0.219, (128, 4032): 0.667}
LEGACY_PREFILL_MS = {
    (64, 0): 0.015,
    (512, 0): 0.072,
    (512, 2048): 0.224,
    (1024, 0): 0.216,
    (2048, 0): 0.681,
    (4096, 0): 2.315,
}
MIXED_SHAPES = {
    "prefill 512": BatchShape(prefill_chunks=[(512, 0)]),
    "prefill 2048": BatchShape(prefill_chunks=[(2048, 0)]),
    "4 chunks 256 @ prefix 1024": BatchShape(prefill_chunks=[(256, 1024)] * 4),
    "1 decode @ 100": BatchShape(num_decodes=1, decode_context_sum=100),
    "64 decodes @ 1024": BatchShape(num_decodes=64, decode_context_sum=64 * 1024),
    "512 chunk + 32 decodes @ 2000": BatchShape(prefill_chunks=[(512, 0)], num_decodes=32, decode_context_sum=64000),
}
MIXED_MODELS = (("llama-2-7b", "a100-80g", 1), ("llama-3-8b", "a100-80g", 1), ("opt-13b", "a100-80g", 1))
MIXED_MODELS += (("llama-2-70b", "a100-80g", 4), ("llama-2-70b", "h100-80g", 4), ("llama-2-7b", "h100-80g", 1))
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def pair(model: str, gpu: str, tp: int = 1) -> tuple[CostModel, CostModel]:
    return build_cost_model("analytic", model, gpu, tp), build_cost_model("profile", model, gpu, tp)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def non_attention_table() -> None:
    print("### Non-attention forward time vs the README table (ratio = model / README)\n")
    readme = "README ms at " + " / ".join(map(str, TOKENS)) + " tokens"
    rows = []
    for (gpu, model, tp), ms in README_MS.items():
        ana, prof = pair(model, gpu, tp)
        p = [prof.non_attention_time(t) * 1e3 / m for t, m in zip(TOKENS, ms, strict=True)]
        a = [ana.non_attention_time(t) * 1e3 / m for t, m in zip(TOKENS, ms, strict=True)]
        row = {"GPU": gpu, "model": model, "TP": str(tp), readme: " / ".join(map(str, ms))}
        rows.append(row | {"profile ratios": fmt(p), "analytic ratios": fmt(a)})
    print_table(rows)
    print()


def fmt(ratios: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in ratios)


def attention_table() -> None:
    ana, prof = pair("llama-2-70b", "a100-80g", 2)  # the legacy file's own head layout
    layers = ana.model.num_layers
    print("### Attention per layer vs the legacy A100 grid (32 q / 4 KV heads per GPU), ms\n")
    rows = []

    def row(kind: str, shape: str, ms: float, p: float, a: float) -> dict[str, str]:
        cells = {"measured": f"{ms:.3f}", "profile": f"{p:.3f}", "analytic": f"{a:.3f}"}
        return {"kind": kind, "shape": shape, **cells, "analytic / measured": f"{a / ms:.2f}"}

    for (b, c), ms in LEGACY_DECODE_MS.items():
        p, a = (m.decode_attention_time(b, b * c) * 1e3 / layers for m in (prof, ana))
        rows.append(row("decode", f"batch {b}, context {c}", ms, p, a))
    for (c, pre), ms in LEGACY_PREFILL_MS.items():
        p, a = (m.prefill_attention_time([(c, pre)]) * 1e3 / layers for m in (prof, ana))
        rows.append(row("prefill", f"chunk {c}, prefix {pre}", ms, p, a))
    print_table(rows)
    print()


def mixed_table() -> None:
    print("### Whole iterations: analytic vs operator profile, ms (ratio analytic / profile)\n")
    rows = []
    for model, gpu, tp in MIXED_MODELS:
        ana, prof = pair(model, gpu, tp)
        row = {"model": model, "GPU": gpu, "TP": str(tp)}
        for name, shape in MIXED_SHAPES.items():
            a, p = ana.iteration_time(shape) * 1e3, prof.iteration_time(shape) * 1e3
            row[name] = f"{a:.1f} / {p:.1f} ({a / p:.2f})"
        rows.append(row)
    print_table(rows)
    print()


def pivot_table() -> None:
    print("### AccelGen pivot forward size (95% of peak tokens/s; published: OPT-13B on A100 ~768)\n")
    rows = []
    for model, gpu in (("opt-13b", "a100-80g"), ("llama-2-7b", "a100-80g"), ("llama-2-7b", "h100-80g")):
        for cm in pair(model, gpu):
            for max_tokens in (4096, 8192):
                size, seconds = pivot_forward_size(cm, max_tokens=max_tokens)
                row = {"model": model, "GPU": gpu, "cost model": cm.name, "grid max": str(max_tokens)}
                row |= {
                    "S_pf": str(size),
                    "T_pf ms": f"{seconds * 1e3:.1f}",
                    "tokens/s at S_pf": f"{size / seconds:.0f}",
                }
                rows.append(row)
    print_table(rows)
    print()


def sarathi_table() -> None:
    print("### Sarathi-Serve Fig. 3 shape: Mistral-7B on A100, tokens/s\n")
    decode = "decode tok/s at batch " + " / ".join(map(str, DECODE_BATCHES)) + " (context 1024)"
    rows = []
    for cm in pair("mistral-7b", "a100-80g"):
        dec = [b / cm.decode_time(b, 1024) for b in DECODE_BATCHES]
        pre = [n / cm.prefill_time(n) for n in (128, 512, 4096)]
        row = {
            "cost model": cm.name,
            decode: " / ".join(f"{d:.0f}" for d in dec),
            "x(64 vs 1)": f"{dec[6] / dec[0]:.1f}",
        }
        row |= {"prefill tok/s at 128 / 512 / 4096": " / ".join(f"{p:.0f}" for p in pre)}
        rows.append(row | {"512 vs 4096": f"{pre[1] / pre[2]:.2f}"})
    print_table(rows)
    print()


def pricing_speed_table(calls: int = 20_000) -> None:
    """The simulator prices every step: one mixed batch should cost microseconds (target 10 us)."""
    print("### Pricing one mixed batch (2 prefill chunks + 40 decodes), microseconds per call\n")
    shape = BatchShape(prefill_chunks=[(300, 500), (200, 0)], num_decodes=40, decode_context_sum=40 * 900)
    rows = []
    for cm in pair("llama-2-70b", "a100-80g", tp=4):
        start = time.perf_counter()
        for _ in range(calls):
            cm.iteration_time(shape)
        per_call = (time.perf_counter() - start) / calls * 1e6
        rows.append({"model": "llama-2-70b TP4", "cost model": cm.name, "us per call": f"{per_call:.2f}"})
    print_table(rows)
    print()


def plot(path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (model, gpu), color in zip((("opt-13b", "a100-80g"), ("llama-2-7b", "a100-80g")), ("C0", "C1"), strict=True):
        for cm, style in zip(pair(model, gpu), ("-", "--"), strict=True):
            curve = throughput_curve(cm, 8192, 32)
            left.plot(
                [s for s, _, _ in curve], [t for _, _, t in curve], style, color=color, label=f"{model} {gpu} {cm.name}"
            )
            size, seconds = pivot_forward_size(cm)
            left.plot([size], [size / seconds], "o", color=color)
    left.axvline(768, color="grey", linestyle=":", label="AccelGen OPT-13B pivot (768)")
    left.axvline(4096, color="black", linestyle="-.", linewidth=0.8, label="end of profiled tokens (4096)")
    left.set(
        xlabel="forward size (prefill tokens, 512-token chunks)",
        ylabel="tokens/s",
        title="Prefill throughput (dots: 95% pivot)",
    )
    left.legend(fontsize=7)
    for model, color in zip(("mistral-7b", "llama-2-7b"), ("C2", "C3"), strict=True):
        for cm, style in zip(pair(model, "a100-80g"), ("-", "--"), strict=True):
            tps = [b / cm.decode_time(b, 1024) for b in DECODE_BATCHES]
            right.plot(DECODE_BATCHES, tps, style + "o", color=color, label=f"{model} a100 {cm.name}")
    right.set(xlabel="decode batch size (context 1024)", ylabel="tokens/s", title="Decode throughput", xscale="log")
    right.legend(fontsize=7)
    fig.suptitle("Sluice cost models: analytic (solid) vs Vidur operator profiles (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--plot", type=Path, default=Path("docs/results/data/costmodel_calibration.png"))
    args = parser.parse_args()
    non_attention_table()
    attention_table()
    mixed_table()
    pivot_table()
    sarathi_table()
    pricing_speed_table()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(args.plot)


if __name__ == "__main__":
    main()
