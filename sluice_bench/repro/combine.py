"""Several runs of one paper as one result: rows of other seeds, rates or systems merged, and
each claim's capacities judged on the merged rows (`benchmarks/repro.py PAPER --combine A.json,B.json`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sluice_bench.repro.claims import PAPERS, Claim
from sluice_bench.repro.runs import Setup, capacity, idle_bound


def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one paper that differ in seeds, rates or systems (e.g. `--first-seed 1 --seeds 2`
    beside an earlier seed-0 run) as one result: per claim, the rows of every run (one row per
    system, rate and seed; a row given twice must be the same run), the systems in the order
    first seen, the seeds and rates of all, the comparisons of the first run that has them.
    Capacities are left empty: `combine_capacities` judges them on the merged rows."""
    if not results:
        raise ValueError("nothing to merge")
    papers = {r["paper"] for r in results}
    if len(papers) != 1:
        raise ValueError(f"runs of one paper only, got {sorted(papers)}")
    claims: dict[str, dict[str, Any]] = {}
    for result in results:
        for res in result["claims"]:
            name = res["claim"]
            if name not in claims:
                claims[name] = {**res, "rows": [], "systems": [], "comparisons": [], "capacity": {}}
            merged = claims[name]
            if res["setup"]["duration_s"] != merged["setup"]["duration_s"]:
                raise ValueError(f"{name}: runs of {res['setup']['duration_s']} and {merged['setup']['duration_s']} s")
            known = {s["label"] for s in merged["systems"]}
            merged["systems"] += [s for s in res["systems"] if s["label"] not in known]
            if not merged["comparisons"]:
                merged["comparisons"] = res["comparisons"]
            seen = {(r["system"], r["rate"], r["seed"]): r for r in merged["rows"]}
            for row in res["rows"]:
                key = (row["system"], row["rate"], row["seed"])
                if key in seen:
                    if seen[key].get("normalized_latency_s") != row.get("normalized_latency_s"):
                        raise ValueError(f"{name}: {key} differs between runs")
                    continue
                seen[key] = row
                merged["rows"].append(row)
    for merged in claims.values():
        rows = merged["rows"]
        merged["setup"] = {
            **merged["setup"],
            "seeds": sorted({r["seed"] for r in rows}),
            "rates": sorted({r["rate"] for r in rows}),
        }
    commands = [r["command"] for r in results]
    return {
        "paper": papers.pop(),
        "command": " && ".join(commands),
        "merged_from": commands,
        "claims": list(claims.values()),
    }


def complete_rates(res: dict[str, Any], label: str) -> list[float]:
    """The rates at which `label` ran every seed of the merged result."""
    seeds = set(res["setup"]["seeds"])
    return [
        rate
        for rate in res["setup"]["rates"]
        if {r["seed"] for r in res["rows"] if r["system"] == label and r["rate"] == rate} == seeds
    ]


def combine_capacities(res: dict[str, Any], claim: Claim, bound: float | None) -> dict[str, Any]:
    """Each system's capacity by `claim`'s rule on the merged rows, over the rates at which it
    ran every seed (no bisection: the grid the runs share); the rule's text beside it."""
    assert claim.rule is not None
    caps: dict[str, Any] = {}
    for system in res["systems"]:
        rates = complete_rates(res, system["label"])
        if not rates:
            continue
        mine = [r for r in res["rows"] if r["system"] == system["label"] and r["rate"] in rates]
        grid = replace(claim, rates=tuple(rates))
        with tqdm(disable=True) as bar:  # no bisection: nothing runs, the arguments for runs are unused
            caps[system["label"]] = capacity(grid, claim.systems[0], mine, bound, Setup(0.0, 0.0, 0), [], 0, bar)
        caps[system["label"]]["rates"] = rates
    return {**res, "capacity": caps, "rule": claim.rule.describe(bound), "bound": bound}


def combine(paths: list[Path]) -> dict[str, Any]:
    """`merge_results` over JSON files, then each claim's capacities on the merged rows, with
    the rule's bound measured again at the lowest merged seed and rate (as a single run does)."""
    merged = merge_results([json.loads(p.read_text()) for p in paths])
    by_name = {c.name: c for c in PAPERS[merged["paper"]]()}
    out = []
    for res in merged["claims"]:
        claim = by_name[res["claim"]]
        if claim.rule is None:
            out.append(res)
            continue
        # the runs' own trace (`--trace` counts a trace in the predictor's tokens, as there)
        trace = res["setup"]["trace"]
        claim = replace(
            claim,
            rates=tuple(res["setup"]["rates"]),
            trace=trace,
            predictor_tokens=claim.predictor_tokens or trace != claim.trace,
        )
        setup = Setup(res["setup"]["duration_s"], res["setup"]["warmup_share"], 200)
        out.append(combine_capacities(res, claim, idle_bound(claim, setup, res["setup"]["seeds"])))
    return {**merged, "claims": out}
