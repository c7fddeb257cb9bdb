"""What a benchmark writes: one JSON writer, one table printer, one plot helper.

write_json(payload, path)       JSON with the machine's paths taken out (a data file names
                                paths relative to the repository); SimRuns: DESIGN.md's
                                `{"policy", "workload", "config", "metrics"}` object per run
format_table(rows, columns)     a markdown table of dicts, numbers to `digits` significant digits
plot_lines(panels, path)        one panel per metric, one line per series, as a PNG
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scheduler_service.sim.simulator import SimRun

ROOT = Path(__file__).resolve().parents[1]


def scrub(value: Any, root: Path = ROOT) -> Any:
    """`value` with every string naming a path under `root` made relative to it."""
    prefix = str(root) + "/"
    if isinstance(value, str):
        return value.replace(prefix, "")
    if isinstance(value, Mapping):
        return {k: scrub(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, root) for v in value]
    return value


def to_payload(value: Any) -> Any:
    """SimRuns as DESIGN.md's `--json` object (the one `sluice simulate --json` writes): one run
    an object, several a list; anything else as it is."""
    if isinstance(value, SimRun):
        return value.to_json()
    if isinstance(value, Sequence) and value and all(isinstance(v, SimRun) for v in value):
        return value[0].to_json() if len(value) == 1 else [r.to_json() for r in value]
    return value


def write_json(
    payload: Any, path: str | Path, *, indent: int | None = 2, sort_keys: bool = False, quiet: bool = False
) -> Path:
    """`payload` (or SimRuns, see `to_payload`) as JSON at `path` (its folder made), paths scrubbed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(scrub(to_payload(payload)), indent=indent, sort_keys=sort_keys, default=str)
    out.write_text(text + "\n")
    if not quiet:
        print(f"wrote {out}", flush=True)
    return out


def fmt(value: Any, digits: int = 3) -> str:
    """A cell: '-' for none or NaN, floats to `digits` significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    digits: int = 3,
    formats: Mapping[str, str] | None = None,
    right: Sequence[str] = (),
) -> str:
    """A markdown table: one line per row, `columns` (default: the first row's keys) in order,
    numeric columns (and those named in `right`) right-aligned; `headers` renames columns,
    `formats` gives a column a format string ("{:.1%}"). No rows: the header alone where
    `columns` are given, else nothing."""
    if not rows and not columns:
        return ""
    cols = list(columns or rows[0].keys())
    names = [(headers or {}).get(c, c) for c in cols]

    def numeric(col: str) -> bool:
        if col in right:
            return True
        values = [r.get(col) for r in rows if r.get(col) is not None]
        return bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)

    # numbers right-aligned, text left
    lines = ["| " + " | ".join(names) + " |", "|" + "".join("---:|" if numeric(c) else "---|" for c in cols)]
    for row in rows:
        cells = []
        for c in cols:
            value = row.get(c)
            spec = (formats or {}).get(c)
            cells.append("-" if value is None else spec.format(value) if spec else fmt(value, digits))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, **kwargs: Any) -> None:
    print(format_table(rows, columns, **kwargs), flush=True)


Series = Mapping[str, Sequence[tuple[float, float]]]


def plot_lines(
    panels: Mapping[str, Series],
    path: str | Path,
    *,
    xlabel: str = "",
    title: str = "",
    bands: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]] | None = None,
    dashed: Sequence[str] = (),
    logx: bool = False,
) -> Path:
    """One panel per key of `panels` (its y label), one line per series (label -> [(x, y)]);
    `bands[panel][label]`: a (low, high) per point, shaded; `dashed`: series drawn dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (ylabel, series) in zip(np.atleast_1d(axes), panels.items(), strict=True):
        for label, points in series.items():
            if not points:
                continue
            x, y = (np.array(v, dtype=float) for v in zip(*points, strict=True))
            ax.plot(x, y, marker="o", ls="--" if label in dashed else "-", label=label)
            band = (bands or {}).get(ylabel, {}).get(label)
            if band:
                lo, hi = (np.array(v, dtype=float) for v in zip(*band, strict=True))
                ax.fill_between(x, lo, hi, alpha=0.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
