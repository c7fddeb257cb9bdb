"""Tables, JSON and plots of simulation runs (one row or bar per policy)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from scheduler_service.sim.simulator import SimRun


def rejected_text(run: SimRun) -> str:
    """'0', or the count and its reasons: '12 (prompt_too_long 10, unschedulable 2)'."""
    by_reason = run.details.get("rejected_by_reason") or {}
    total = sum(by_reason.values())
    if not total:
        return "0"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    return f"{total} ({reasons})"


_COLUMNS = (
    ("policy", lambda r: r.policy, "{}"),
    ("done", lambda r: f"{r.metrics['num_finished']}/{r.metrics['num_requests']}", "{}"),
    ("rejected", rejected_text, "{}"),
    ("tok/s", lambda r: r.metrics["throughput_tok_s"], "{:.0f}"),
    ("req/s", lambda r: r.metrics["throughput_req_s"], "{:.2f}"),
    ("goodput", lambda r: r.metrics["goodput_req_s"], "{:.2f}"),
    ("TTFT p50", lambda r: r.metrics["ttft_s"]["p50"], "{:.2f}"),
    ("TTFT p99", lambda r: r.metrics["ttft_s"]["p99"], "{:.2f}"),
    ("TBT p99", lambda r: r.metrics["tbt_s"]["p99"], "{:.3f}"),
    ("JCT p50", lambda r: r.metrics["jct_s"]["p50"], "{:.1f}"),
    ("norm lat", lambda r: r.metrics["normalized_latency_s"], "{:.3f}"),
    ("SLO iter", lambda r: r.metrics["slo_attainment_iter"], "{:.1%}"),
    ("SLO req", lambda r: r.metrics["slo_attainment_req"], "{:.1%}"),
    ("util", lambda r: r.metrics["compute_util_mean"], "{:.2f}"),
    ("KV", lambda r: r.metrics["kv_util_mean"], "{:.2f}"),
    ("KV used", lambda r: r.metrics["kv_used_mean"], "{:.2f}"),
    ("preempt", lambda r: r.metrics["preemptions"], "{}"),
    ("sched ms p99", lambda r: r.metrics["sched_overhead_ms"]["p99"], "{:.3f}"),
)


def _cell(fmt: str, value: object) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(runs: Sequence[SimRun]) -> str:
    rows = [[name for name, _, _ in _COLUMNS]]
    rows += [[_cell(fmt, get(r)) for _, get, fmt in _COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(runs: Sequence[SimRun], path: str | Path) -> None:
    """One policy: the object of DESIGN.md; several: a list of them."""
    payload = runs[0].to_json() if len(runs) == 1 else [r.to_json() for r in runs]
    Path(path).write_text(json.dumps(payload, indent=2))


def plot_runs(runs: Sequence[SimRun], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("throughput (output tok/s)", lambda r: r.metrics["throughput_tok_s"]),
        ("TTFT p50 / p99 (s)", lambda r: (r.metrics["ttft_s"]["p50"], r.metrics["ttft_s"]["p99"])),
        ("TBT p50 / p99 (s)", lambda r: (r.metrics["tbt_s"]["p50"], r.metrics["tbt_s"]["p99"])),
        ("normalized latency (s/token)", lambda r: r.metrics["normalized_latency_s"]),
    )
    names = [r.policy for r in runs]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (label, get) in zip(axes, panels, strict=True):
        values = [get(r) for r in runs]
        if isinstance(values[0], tuple):
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [v[0] or 0 for v in values], 0.4, label="p50")
            ax.bar([x + 0.2 for x in xs], [v[1] or 0 for v in values], 0.4, label="p99")
            ax.legend(fontsize=8)
        else:
            ax.bar(range(len(names)), [v or 0 for v in values], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
