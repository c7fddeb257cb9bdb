"""One command per paper: its headline claim, as two labelled comparisons, run the way a reviewer would accept.

    python benchmarks/repro.py PAPER [--claim NAME] [--quick] [--seeds 3] [--duration 300]
                                     [--out docs/results/data/repro] [--length-source predictor[:DIR]]
    python benchmarks/repro.py econoserve --regroup 0.25,0.5,1,2     # the regroup factor, measured

PAPER is sarathi, accelgen, econoserve, scls or alise. Each claim holds the paper's number as
data (`Claim.paper_ratio`) and two comparisons (`Claim.comparisons`), printed side by side:
- **published**: the paper's system as published against the paper's baseline as published,
  same model, GPU and KV bytes, each system with its own published engine features (ALISE:
  hybrid batching and resident int8 KV, `System.int8_kv`; vLLM: prefill-only iterations, fp16);
  only this one is set against the paper's number;
- **equal-engine**: both systems on one batching engine and KV precision, which isolates the
  scheduling idea; an ablation, never called paper-faithful.
Every system of a claim gets the same model, GPU, KV bytes, block size and the claim's
`common` settings (one swap pricing for all); the only per-system settings are those of its
own design (`System.extra`). Systems marked "ours" carry an extra the paper does not have and
are in no comparison. Runs:
- arrival rates are swept (Poisson), each run a fixed simulated duration of arrivals
  (`--duration`, or the claim's), whose first `--warmup` share is excluded from the latency,
  SLO and throughput numbers (steady state: the measured requests arrive into a loaded system);
- several seeds (`--seeds`); each seed draws other lengths for every trace format (a generator
  samples with it; a file is read whole and sampled with it) and other arrivals; shown as the
  mean and the min-max band; a claim may cut lengths to the paper's limits (`max_input`,
  `max_output`);
- capacity, where the paper claims one, is the largest swept rate whose seeds' mean meets
  the paper's rule, refined by bisection between it and the next rate (`--refine` probes);
  a system that misses the rule at the lowest swept rate is "< floor", never searched below;
- each row carries the mechanism counters of the policy (`counters`, from the simulator's
  `details.policy_stats`) and of the router (`router_counters`), so a table can show that a
  paper's mechanism ran (`Claim.counters` picks the columns printed).
Writes `<out>/<paper>.json` (every run) and `<out>/<paper>_<claim>.png` (one plot per claim),
and prints markdown tables. `--length-source SRC` gives every system that reads predicted
lengths (those not on `max_tokens`) SRC instead, labelled "system (SRC)", and writes
`<out>/<paper>_<SRC>.json` and `..._<SRC>.png`; `predictor` is the real predictor on a trace
with prompt text and, on a trace without (the papers' length generators), predictions drawn
from the predictor's held-out error model (`predictor_service/trace_lengths.py`). `--quick` (one seed, one
short run per system, one rate) is what the tests run. `--jobs N` runs a claim's independent
simulations in N local processes, `--ray ADDRESS` as Ray tasks; the results are the serial run's.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.predictor_lengths import is_online_source, is_predictor_source
from sluice_bench.options import Parallelism, add_parallel_options, benchmark_parser
from sluice_bench.repro.claims import PAPERS, _econoserve_regroup, with_length_source
from sluice_bench.repro.combine import combine
from sluice_bench.repro.runs import HELD_OUT, Setup, run_claim, scls_cause
from sluice_bench.repro.tables import claim_tables, plot


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__)
    parser.add_argument("paper", choices=sorted(PAPERS))
    parser.add_argument("--claim", help="run only this claim of the paper (e.g. alise's sharegpt)")
    parser.add_argument("--systems", help="comma-separated labels: run only these systems of the claim(s)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--rates", help="comma-separated arrival rates instead of each claim's own sweep")
    parser.add_argument(
        "--duration",
        type=float,
        help="simulated seconds of arrivals per run, over the claim's own (default: the claim's, else 300)",
    )
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the arrival span excluded as warm-up")
    parser.add_argument("--min-requests", type=int, default=200)
    parser.add_argument("--refine", type=int, default=1, help="bisection probes per capacity beyond the sweep")
    parser.add_argument("--quick", action="store_true", help="one seed, one rate, 60 s: a smoke run")
    parser.add_argument("--out", default="docs/results/data/repro")
    parser.add_argument("--cause", action="store_true", help="scls only: where its GPU time goes against FastGen's")
    parser.add_argument(
        "--length-source",
        help="predicted lengths for every system that reads them: oracle, noisy_oracle or predictor[:DIR]",
    )
    parser.add_argument(
        "--regroup",
        help="econoserve only: sweep the misprediction regroup_factor over these values (comma-separated), "
        "with the real predictor on ShareGPT prompts",
    )
    parser.add_argument(
        "--trace",
        help=f"run the claim(s) on this trace instead (e.g. {HELD_OUT}: the predictor's held-out ShareGPT first "
        "turns, with text, for predictor-online)",
    )
    parser.add_argument(
        "--combine",
        help="comma-separated JSON files of earlier runs of PAPER (other seeds, rates or systems): merge their rows, "
        "judge capacities on the merged rows (rates every seed ran) and write <out>/<name>.json",
    )
    parser.add_argument("--name", help="base name of the files written (default: from the paper and the options)")
    add_parallel_options(parser)
    args = parser.parse_args(argv)
    parallelism = Parallelism.from_args(args)
    if args.combine:
        merged = combine([Path(p) for p in args.combine.split(",")])
        if merged["paper"] != args.paper:
            parser.error(f"--combine files are runs of {merged['paper']}, not {args.paper}")
        seeds = sorted({s for c in merged["claims"] for s in c["setup"]["seeds"]})
        name = args.name or f"{args.paper}_merged_seeds{seeds[0]}-{seeds[-1]}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for res in merged["claims"]:
            plot(res, out / f"{name}_{res['claim']}.png")
            print(claim_tables(res), flush=True)
            print(flush=True)
        (out / f"{name}.json").write_text(json.dumps(merged, indent=1, default=str))
        return merged
    if args.cause:
        if args.paper != "scls":
            parser.error("--cause is measured for scls only")
        return {"paper": "scls", "cause": scls_cause()}
    claims = PAPERS[args.paper]()
    name = args.paper
    if args.claim:
        known = [c.name for c in claims]
        if args.claim not in known:
            parser.error(f"--claim must be one of {', '.join(known)} for {args.paper}, got {args.claim!r}")
        claims = [c for c in claims if c.name == args.claim]
        name = f"{name}_{args.claim}"
    if args.regroup:
        if args.paper != "econoserve":
            parser.error("--regroup is measured for econoserve only")
        try:
            factors = tuple(float(f) for f in args.regroup.split(","))
        except ValueError:
            parser.error(f"--regroup must be comma-separated numbers, got {args.regroup!r}")
        claims, name = _econoserve_regroup(factors), "econoserve_regroup"
    if args.systems:
        wanted = set(args.systems.split(","))
        known = {s.label for c in claims for s in c.systems}
        if not wanted <= known:
            parser.error(f"--systems must name systems of the claim: {', '.join(sorted(known))}")
        # the comparisons need both sides; a partial run reports no capacity ratio
        claims = [
            replace(c, systems=tuple(s for s in c.systems if s.label in wanted), comparisons=(), rule=None)
            for c in claims
        ]
        name = f"{name}_{'-'.join(sorted(wanted))}"
    if args.rates:
        try:
            rates = tuple(sorted(float(r) for r in args.rates.split(",")))
        except ValueError:
            parser.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
        claims = [replace(c, rates=rates) for c in claims]
        name = f"{name}_{'-'.join(f'{r:g}' for r in rates)}"  # beside, not over, the full sweep's file
    if args.trace:
        # NOTE: a text trace is counted in the predictor's tokens, the unit its predictions are in
        claims = [replace(c, trace=args.trace, predictor_tokens=True) for c in claims]
        name = f"{name}_{args.trace}"
    if args.length_source:
        known = ("oracle", "noisy_oracle", "max_tokens")
        src = args.length_source
        if src not in known and not is_predictor_source(src) and not is_online_source(src):
            parser.error(
                f"--length-source must be one of {', '.join(known)}, predictor[:DIR] or predictor-online[:DIR]"
            )
        claims = [with_length_source(c, args.length_source) for c in claims]
        name = f"{name}_{args.length_source.split(':')[0]}"
    if args.duration is not None and not args.quick:
        claims = [replace(c, duration_s=args.duration) for c in claims]
    if args.quick:
        setup, seeds = Setup(60.0, args.warmup, 30), [0]
    else:
        setup = Setup(args.duration or 300.0, args.warmup, args.min_requests)
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.first_seed and not args.quick:
        name = f"{name}_seeds{seeds[0]}-{seeds[-1]}"
    name = args.name or name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"paper": args.paper, "command": "python benchmarks/repro.py " + " ".join(argv or []), "claims": []}
    for claim in claims:
        res = run_claim(claim, setup, seeds, args.refine, args.quick, parallelism)
        results["claims"].append(res)
        plot(res, out / f"{name}_{claim.name}.png")
        print(claim_tables(res), flush=True)
        print(flush=True)
    # NOTE: not report.write_json: this file's layout (indent 1, no trailing newline) is what the
    # published reproductions hold, and reruns are compared with them byte for byte
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    return results
