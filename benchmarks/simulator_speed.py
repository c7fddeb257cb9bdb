"""Simulator speed: requests simulated per second for every policy on the sharegpt trace
(10,000 requests by default), the cost of automatic prefix caching on that trace (it has no
shared prefixes: every block is unique to its request), and both against a baseline tree
(by default `main`), side by side in one run.

    python benchmarks/simulator_speed.py                       # every policy, this tree and main's
    python benchmarks/simulator_speed.py --num-requests 2000 --rounds 3 --policy vllm --policy sarathi
    python benchmarks/simulator_speed.py --baseline none       # this tree only

The baseline is `git archive`d into a temporary folder and imported from there; each
(tree, policy, prefix caching) run is its own subprocess, and the variants are interleaved
round by round, so a slow minute of a shared machine lands on all of them alike (`--clock cpu`
compares the processes' CPU time instead of wall time, which other jobs on a shared machine
inflate by whole multiples). Printed per policy: the median time per variant, requests/s, the speedup over the baseline
(baseline wall / this tree's wall, caching on and off), and the prefix-caching overhead
(wall on / wall off - 1) of each tree. Both trees make the same decisions
(tests/sim/test_plan_identity.py); `finished` and `steps` show it per run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from tqdm import tqdm

from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
POLICIES = [
    "vllm",
    "vllm_chunked",
    "sarathi",
    "orca",
    "sls",
    "fastgen",
    "fastserve",
    "alise",
    "scls",
    "econoserve",
    "accelgen",
]

# What one subprocess runs: a simulation of the trace, timed, its counts printed as JSON.
_CHILD = """
import json, os, sys, time
from dataclasses import fields
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, simulate
if os.path.isdir("scheduler_service/workloads"):  # the tree in the working directory decides
    from scheduler_service.workloads import apply_arrivals, load_trace
else:  # a tree from before the workloads left sim/
    from scheduler_service.sim.workloads import apply_arrivals, load_trace
policy, n, rate, caching = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
cm = build_cost_model("analytic", "llama-2-7b", "a100-80g")
wl = apply_arrivals(load_trace("sharegpt", num_requests=n), "poisson", rate=rate, seed=0)
# the papers' setting, spelt so that every tree understands it (steps one after another, queues
# without bound, 16 GiB of swap, no offline queue)
names = {f.name for f in fields(SimConfig)}
setting = {"overlap": False, "max_waiting": 1_000_000}
setting["swap_space_gib" if "swap_space_gib" in names else "swap_space_gb"] = 16.0
setting.update({"max_offline_waiting": 0} if "max_offline_waiting" in names else {})
t0, c0 = time.perf_counter(), time.process_time()
run = simulate(SimConfig(policy=policy, max_model_len=8192, prefix_caching=caching, **setting), wl, cm)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
counts = {"steps": run.details["num_steps"], "finished": run.metrics["num_finished"]}
print(json.dumps({"wall": wall, "cpu": cpu, **counts}))
"""


def extract_tree(ref: str, into: Path) -> Path:
    """The tree of `ref` (a commit or branch of this repository), unpacked under `into`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=True)
    tree = into / "baseline"
    with tarfile.open(fileobj=BytesIO(data.stdout)) as tar:
        tar.extractall(tree, filter="data")
    data_dir = tree / "data"
    if not any(data_dir.glob("traces/*")):  # NOTE: bundled data may be LFS pointers in an archive
        subprocess.run(["rm", "-rf", str(data_dir)], check=True)
        data_dir.symlink_to(ROOT / "data")
    return tree


def run_one(tree: Path, policy: str, n: int, rate: float, caching: bool) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, policy, str(n), str(rate), "1" if caching else "0"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{policy} in {tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (median reported)")
    parser.add_argument("--policy", action="append", help="policy spec; repeat (default: every policy)")
    parser.add_argument("--baseline", default="main", help="git ref to compare with, or 'none'")
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what is compared: wall time, or the process's CPU time (steadier on a shared machine)",
    )
    args = parser.parse_args()
    policies = args.policy or POLICIES
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if args.baseline != "none":
            trees["base"] = extract_tree(args.baseline, Path(tmp))
        variants = [(t, p, c) for p in policies for t in trees for c in (True, False)]
        runs: dict[tuple[str, str, bool], list[dict[str, float]]] = {v: [] for v in variants}
        with tqdm(total=len(variants) * args.rounds, desc="simulations") as bar:
            for _ in range(args.rounds):
                for v in variants:
                    runs[v].append(run_one(trees[v[0]], v[1], args.num_requests, args.rate, v[2]))
                    bar.update(1)
    if args.json:
        write_json({"|".join(map(str, k)): r for k, r in runs.items()}, args.json, indent=1, quiet=True)
    wall = {k: statistics.median(r[args.clock] for r in rs) for k, rs in runs.items()}
    print(f"{args.num_requests} sharegpt requests, {args.rounds} round(s), median {args.clock} s")
    rows = []
    for p in policies:
        on, off = wall[("this", p, True)], wall[("this", p, False)]
        row = {"policy": p, "on s": on, "off s": off, "req/s": args.num_requests / on, "APC cost": on / off - 1}
        if "base" in trees:
            b_on, b_off = wall[("base", p, True)], wall[("base", p, False)]
            same = all(
                (a["steps"], a["finished"]) == (b["steps"], b["finished"])
                for c in (True, False)
                for a, b in zip(runs[("this", p, c)], runs[("base", p, c)], strict=True)
            )
            row |= {"base on": b_on, "base off": b_off, "base APC": b_on / b_off - 1}
            row |= {"speedup on": b_on / on, "speedup off": b_off / off, "same": "yes" if same else "NO"}
        rows.append(row)
    two, apc, speedup = "{:.2f}", "{:+.1%}", "{:.2f}x"
    formats = {"on s": two, "off s": two, "req/s": "{:.0f}", "APC cost": apc, "base on": two, "base off": two}
    print_table(rows, formats=formats | {"base APC": apc, "speedup on": speedup, "speedup off": speedup})

if __name__ == "__main__":
    main()
