"""A claim's results as markdown tables and one PNG per claim."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sluice_bench.report import fmt, format_table, plot_lines
from sluice_bench.repro.runs import _band, _mean


def claim_tables(res: dict[str, Any]) -> str:
    labels = [s["label"] for s in res["systems"]]
    key = res["metrics"][0]
    base = res["baseline"]
    lines = [f"### {res['title']}", "", f"Paper: {res['paper_says']}.", ""]
    table = []
    for rate in res["setup"]["rates"]:
        row = {"rate (req/s)": f"{rate:g}"}
        for lab in labels:
            mean, lo, hi = _band([r for r in res["rows"] if r["system"] == lab and r["rate"] == rate], key)
            row[f"{lab} {key} (mean [min, max])"] = f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}]"
        table.append(row)
    lines.append(format_table(table, ["rate (req/s)", *(f"{lab} {key} (mean [min, max])" for lab in labels)]))
    if res["capacity"]:
        lines += ["", f"Capacity ({res['rule']}):", ""]
        ref = res["capacity"].get(base, {}).get("capacity")
        caps = []
        for lab in labels:
            c = res["capacity"][lab]
            if c["below_floor"]:
                text, ratio = f"< {c['floor']:g} (floor)", "-"
            else:
                text = f"{c['capacity']:.2f}" + (" (beyond the sweep)" if c.get("beyond_sweep") else "")
                ratio = f"{c['capacity'] / ref:.2f}x" if ref else "-"
            caps.append({"system": lab, "capacity (req/s)": text, f"vs {base}": ratio})
        lines.append(format_table(caps))
    if any(r.get("norm_latency_late_s") is not None for r in res["rows"]) and res["capacity"]:
        lines += ["", growth_table(res)]
    if res.get("comparisons"):
        lines += ["", comparison_table(res)]
    if res.get("counters"):
        lines += ["", mechanism_table(res)]
    if any("regrouped" in r for r in res["rows"]):
        lines += ["", counter_table(res)]
    return "\n".join(lines)


def _ratio_text(res: dict[str, Any], sys_label: str, base_label: str) -> str:
    """Capacity ratio where the claim has a rule; else the headline metric's ratio per rate:
    ratio of the seed means [min, max of the per-seed ratios], with the counts behind goodput."""
    caps = res.get("capacity") or {}
    if caps:
        a, b = caps.get(sys_label, {}), caps.get(base_label, {})
        if a.get("below_floor") or b.get("below_floor") or not a or not b:
            return "below the floor: " + (sys_label if a.get("below_floor") else base_label)
        ratio = a["capacity"] / b["capacity"]
        text = f"**{ratio:.2f}x** ({a['capacity']:.2f} vs {b['capacity']:.2f} req/s)"
        if b.get("beyond_sweep") and not a.get("beyond_sweep"):
            text = "<= " + text
        elif a.get("beyond_sweep") and not b.get("beyond_sweep"):
            text = ">= " + text
        elif a.get("beyond_sweep") and b.get("beyond_sweep"):
            text += " (both beyond the sweep)"
        return text
    key = res["metrics"][0]
    parts = []
    for rate in res["setup"]["rates"]:
        mine = {r["seed"]: r for r in res["rows"] if r["system"] == sys_label and r["rate"] == rate}
        base = {r["seed"]: r for r in res["rows"] if r["system"] == base_label and r["rate"] == rate}
        seeds = sorted(set(mine) & set(base))
        if not seeds:
            continue
        m = float(np.mean([mine[k][key] or 0.0 for k in seeds]))
        b = float(np.mean([base[k][key] or 0.0 for k in seeds]))
        per_seed = [(mine[k][key] or 0.0) / base[k][key] for k in seeds if base[k][key]]
        text = f"{rate:g}: {fmt(m / b) if b else '-'}x"
        if per_seed:
            text += f" [{fmt(min(per_seed))}, {fmt(max(per_seed))}]"
        if key.startswith("goodput"):
            good_m = sum(mine[k]["num_good"] for k in seeds)
            good_b = sum(base[k]["num_good"] for k in seeds)
            judged = sum(base[k]["num_judged"] for k in seeds)
            text += f" ({good_m} vs {good_b} of {judged} requests met their SLO)"
        parts.append(text)
    return "; ".join(parts) or "-"


def growth_table(res: dict[str, Any]) -> str:
    """Normalized latency of the measured window's second half over its first (by arrival),
    mean over seeds: about 1 in a steady state, well above 1 while a queue still grows."""
    rates = res["setup"]["rates"]
    table = []
    for s in res["systems"]:
        row = {"system": s["label"]}
        for rate in rates:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            ratios = [
                r["norm_latency_late_s"] / r["norm_latency_early_s"] for r in rows if r.get("norm_latency_early_s")
            ]
            row[f"{rate:g}"] = fmt(float(np.mean(ratios))) if ratios else "-"
        table.append(row)
    return "\n".join(
        [
            "Steady state: normalized latency, second half of the measured arrivals over the first (mean over seeds)",
            "",
            format_table(table, ["system", *(f"{r:g}" for r in rates)]),
        ]
    )


def comparison_table(res: dict[str, Any]) -> str:
    table = [
        {
            "comparison": c["kind"],
            "system vs baseline": f"{c['system']} vs {c['baseline']}",
            "ratio": _ratio_text(res, c["system"], c["baseline"]),
            "what each side brings": c["note"],
        }
        for c in res["comparisons"]
    ]
    columns = ["comparison", "system vs baseline", "ratio", "what each side brings"]
    return "\n".join(["Comparisons:", "", format_table(table, columns)])


def mechanism_table(res: dict[str, Any]) -> str:
    """The paper mechanisms' counters (`details.policy_stats`, `router_stats`), mean over seeds."""
    keys = res["counters"]
    table = []
    for s in res["systems"]:
        for rate in res["setup"]["rates"]:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            if not rows or not any(r.get("counters") or r.get("router_counters") for r in rows):
                continue
            # a counter a policy keeps but never moved is absent from its report: 0
            merged = [{**r.get("router_counters", {}), **r.get("counters", {})} for r in rows]
            vals = {k: fmt(float(np.mean([m.get(k, 0) for m in merged])), 4) for k in keys}
            table.append({"system": s["label"], "rate": f"{rate:g}", **vals})
    head = "Mechanism counters (mean over seeds, whole run): " + ", ".join(keys)
    return "\n".join([head, "", format_table(table, ["system", "rate", *keys])])


def counter_table(res: dict[str, Any]) -> str:
    """EconoServe's misprediction counters and the preemptions, mean over seeds per rate."""
    rates = sorted({r["rate"] for r in res["rows"]})
    keys = ("regrouped", "mispredicted_kept", "preemptions")
    table = []
    for s in res["systems"]:
        row = {"system": s["label"]}
        for rate in rates:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            row[f"{rate:g} req/s"] = " / ".join(fmt(_mean(rows, k), 4) for k in keys) if rows else "-"
        table.append(row)
    head = "Mean over seeds: regrouped / stopped at a full allocation (mispredicted_kept) / preemptions"
    return "\n".join([head, "", format_table(table, ["system", *(f"{r:g} req/s" for r in rates)])])


def plot(res: dict[str, Any], path: Path) -> None:
    """One panel per metric of the claim against the rate: each system's mean over seeds, its
    min-max band shaded; the systems marked "ours" dashed."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    bands: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key in res["metrics"]:
        panels[key], bands[key] = {}, {}
        for s in res["systems"]:
            rates = sorted({r["rate"] for r in res["rows"] if r["system"] == s["label"]})
            points = [
                _band([r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == x], key) for x in rates
            ]
            panels[key][s["label"]] = [(x, mean) for x, (mean, _, _) in zip(rates, points, strict=True)]
            bands[key][s["label"]] = [(lo, hi) for _, lo, hi in points]
    dashed = [s["label"] for s in res["systems"] if s["ours"]]
    plot_lines(panels, path, xlabel="arrival rate (req/s)", title=res["title"], bands=bands, dashed=dashed)
