"""Sluice's policies inside vLLM (`sluice_vllm`), measured.

    overhead   the plug-in's added time per step at 256 running requests: vLLM's own
               Scheduler and the plug-in's (each policy), no model, the same requests,
               interleaved rounds (target: under 0.5 ms added)
    serve      the same trace through `vllm serve` (a tiny dummy-weight Llama on CPU) with
               vLLM's own scheduler and with each plug-in policy, one streaming OpenAI client:
               TTFT/TBT p50/p99, mean normalized latency, goodput under SLOs, at three loads;
               FCFS plug-in vs vLLM's own scheduler interleaved over repeats (target: within
               2% in throughput and TBT); ALISE vs FCFS mean normalized latency (target 1.3x)

    python benchmarks/vllm_plugin.py overhead --rounds 5 --steps 200
    python benchmarks/vllm_plugin.py serve --out docs/results/data/vllm_plugin.json

The trace: Poisson arrivals; prompts 32-256 tokens; 70% short answers (8-32 tokens), 30% long
ones (64-160); every request carries hints (oracle predicted_tokens, a TTFT and TBT SLO for
online requests, jct_ms for the 20% offline ones, priority 0 for 30% of them). Outputs run to
max_tokens (ignore_eos) so every scheduler generates the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler_service.core.slo import SLOSpec, judge_slo
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table, write_json
from sluice_bench.vllm_plugin_harness import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]

SERVE_FLAGS = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
    "--kv-cache-memory-bytes", str(256 * 2**20), "--block-size", "32", "--max-model-len", "2048",
    "--max-num-batched-tokens", "1024", "--no-enable-prefix-caching",
]  # fmt: skip
TTFT_SLO_S = 1.0  # online requests' SLOs for goodput (and their hints)
TBT_SLO_S = 0.1


# ---------------------------------------------------------------------------- overhead


def cmd_overhead(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from sluice_bench.vllm_plugin_harness import build_scheduler, make_request, step
    from sluice_vllm.scheduler import SluiceScheduler
    from sluice_vllm.vllm_compat import Scheduler

    variants = {"vllm": None, **{p: p for p in args.policy}}
    rng = random.Random(0)
    reqs = [(rng.randint(32, 256), rng.randint(1000, 1500), rng.randint(8, 400)) for _ in range(args.running + 64)]

    def fresh(policy: str | None) -> Any:
        kw = {"max_num_seqs": args.running, "max_num_batched_tokens": 8192, "num_blocks": args.running * 60}
        if policy is None:
            s = build_scheduler(Scheduler, **kw)
        else:
            s = build_scheduler(SluiceScheduler, env={"SLUICE_VLLM_POLICY": policy}, **kw)
        for i, (p, n, pred) in enumerate(reqs):
            s.add_request(make_request(f"r{i}", p, n, arrival=i, priority=i % 3, predicted_tokens=pred, tbt_ms=100))
        while len(s.running) < args.running:  # admit (prefills) until 256 run; 64 stay waiting
            step(s)
        return s

    out: dict[str, Any] = {"running": args.running, "waiting": 64, "rounds": args.rounds, "steps": args.steps}
    step_ms: dict[str, list[float]] = {v: [] for v in variants}
    own_ms: dict[str, list[float]] = {v: [] for v in variants if v != "vllm"}
    own_p99: dict[str, list[float]] = {v: [] for v in own_ms}
    own_median: dict[str, list[float]] = {v: [] for v in own_ms}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        schedulers = {name: fresh(policy) for name, policy in variants.items()}
        for s in schedulers.values():
            for _ in range(10):
                step(s)  # warm
            if hasattr(s, "sluice_counters"):
                s.sluice_counters.clear()
        per: dict[str, list[float]] = {v: [] for v in variants}
        own: dict[str, list[float]] = {v: [] for v in own_ms}
        names = list(schedulers)
        for k in range(args.steps):  # interleaved: each step of each variant, in a rotating order
            for name in names[k % len(names) :] + names[: k % len(names)]:
                s = schedulers[name]
                before = s.sluice_counters["plugin_s"] if name in own else 0.0
                t = time.perf_counter()
                step(s)
                per[name].append(time.perf_counter() - t)
                if name in own:
                    own[name].append(s.sluice_counters["plugin_s"] - before)
        for name, s in schedulers.items():
            assert len(s.running) == args.running, name
            step_ms[name].append(float(np.median(per[name])) * 1e3)
            if name in own_ms:
                # NOTE: the mean is the added time per step; the median and p99 show its shape
                # (policies that refresh their keys every few steps pay it in those steps).
                own_ms[name].append(float(np.mean(own[name])) * 1e3)
                own_median[name].append(float(np.median(own[name])) * 1e3)
                own_p99[name].append(float(np.percentile(own[name], 99)) * 1e3)
    base = step_ms["vllm"]
    rows = []
    for name in variants:
        diff = [a - b for a, b in zip(step_ms[name], base, strict=True)]
        mine, p99, mid = own_ms.get(name, [0.0]), own_p99.get(name, [0.0]), own_median.get(name, [0.0])
        out[name] = {
            "step_ms": step_ms[name],
            "vs_vllm_ms": diff,
            "plugin_ms_per_step": own_ms.get(name),
            "plugin_ms_median_step": own_median.get(name),
            "plugin_ms_p99": own_p99.get(name),
        }
        rows.append(
            {
                "scheduler": name,
                "step ms": statistics.median(step_ms[name]),
                "vs vllm ms": statistics.median(diff),
                "plug-in ms/step": statistics.median(mine),
                "range": f"{min(mine):.3f}..{max(mine):.3f}",
                "median step": statistics.median(mid),
                "p99": max(p99),
            }
        )
    ms = "{:.3f}"
    print_table(
        rows, formats={"step ms": ms, "vs vllm ms": ms, "plug-in ms/step": ms, "median step": ms, "p99": "{:.2f}"}
    )
    if args.out:
        write_json(out, args.out, indent=1, quiet=True)
    return 0


# ---------------------------------------------------------------------------- trace and client


@dataclass
class TraceItem:
    rid: str
    at: float
    prompt: list[int]
    out: int
    priority: int
    xargs: dict[str, Any]
    online: bool


def make_trace(rate: float, n: int, seed: int) -> list[TraceItem]:
    rng = random.Random(seed)
    t = 0.0
    items = []
    for i in range(n):
        t += rng.expovariate(rate)
        out = rng.randint(8, 32) if rng.random() < 0.7 else rng.randint(64, 160)
        plen = rng.randint(32, 256)
        online = rng.random() >= 0.2
        xargs: dict[str, Any] = {"predicted_tokens": out}
        if online:
            xargs |= {"ttft_ms": TTFT_SLO_S * 1e3, "tbt_ms": TBT_SLO_S * 1e3}
        else:
            xargs |= {"jct_ms": 60_000, "slo_class": "offline"}
        prompt = [3 + (rng.randrange(500)) for _ in range(plen)]
        items.append(TraceItem(f"q{i}", t, prompt, out, 0 if rng.random() < 0.3 else 1, xargs, online))
    return items


def slo_of(item: TraceItem) -> SLOSpec:
    """The SLOs the request carries: online ones by TTFT and TBT, offline ones by JCT."""
    if item.online:
        return SLOSpec(ttft_s=item.xargs["ttft_ms"] / 1e3, tbt_s=item.xargs["tbt_ms"] / 1e3)
    return SLOSpec(jct_s=item.xargs["jct_ms"] / 1e3)


@dataclass
class Result:
    rid: str
    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def one_request(session: Any, url: str, item: TraceItem, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + item.at - time.monotonic()))
    res = Result(item.rid, time.monotonic())
    body = {
        "model": TINY_MODEL,
        "prompt": item.prompt,
        "max_tokens": item.out,
        "ignore_eos": True,
        "stream": True,
        "priority": item.priority,
        "vllm_xargs": item.xargs,
        "return_token_ids": True,
    }
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or ():
                    # a loaded API server merges several tokens into one chunk: each counts
                    ids = choice.get("token_ids")
                    res.token_times += [time.monotonic()] * (len(ids) if ids is not None else 1)
    except Exception as exc:  # a failed request is reported, never counted as served
        res.error = repr(exc)
    res.tokens = len(res.token_times)
    return res


async def replay(base: str, trace: list[TraceItem]) -> tuple[list[Result], float]:
    import aiohttp

    url = f"{base}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic() + 0.2
        results = await asyncio.gather(*(one_request(session, url, it, t0) for it in trace))
        return list(results), time.monotonic() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def summarize(trace: list[TraceItem], results: list[Result], wall_s: float) -> dict[str, Any]:
    by_id = {it.rid: it for it in trace}
    ok = [r for r in results if r.error is None and r.tokens > 0]
    ttft = [r.token_times[0] - r.sent for r in ok]
    tbt = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    norm = [(r.token_times[-1] - r.sent) / by_id[r.rid].out for r in ok]
    good = sum(judge_slo(slo_of(by_id[r.rid]), r.sent, r.token_times).met for r in ok)
    short = [(r.token_times[-1] - r.sent) / by_id[r.rid].out for r in ok if by_id[r.rid].out <= 32]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "tokens_match": all(r.tokens == by_id[r.rid].out for r in ok),
        "throughput_tok_s": sum(r.tokens for r in ok) / wall_s,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tbt_p50_s": pct(tbt, 50),
        "tbt_p99_s": pct(tbt, 99),
        "mean_norm_latency_s": statistics.mean(norm) if norm else float("nan"),
        "mean_norm_latency_short_s": statistics.mean(short) if short else float("nan"),
        "goodput_req_s": good / wall_s,
        "slo_attainment": good / len(results),
        "wall_s": wall_s,
    }


# ---------------------------------------------------------------------------- servers


class Server:
    """`vllm serve` through the project's launcher: vLLM's own scheduler (policy None) or the plug-in."""

    def __init__(self, policy: str | None, port: int, max_num_seqs: int, log_dir: Path) -> None:
        self.policy = policy
        self.base = f"http://127.0.0.1:{port}"
        self.trace = log_dir / f"trace-{port}.jsonl"
        cmd = [sys.executable, "-m", "sluice_vllm.launcher", "serve", TINY_MODEL, *SERVE_FLAGS]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if policy is not None:
            cmd += ["--scheduler-cls", "sluice_vllm.scheduler.SluiceScheduler"]
            env |= {"SLUICE_VLLM_POLICY": policy, "SLUICE_VLLM_TRACE": str(self.trace)}
        self.log = (log_dir / f"serve-{port}.log").open("w")
        # its own process group, so stopping it reaches the engine core and worker it spawns
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self, timeout_s: float = 1200) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.policy}) exited; see {self.log.name}")
            try:
                urllib.request.urlopen(f"{self.base}/v1/models", timeout=5).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve ({self.policy}) did not come up") from None
                time.sleep(1.0)

    def counters(self) -> dict[str, float]:
        if not self.trace.exists():
            return {}
        events = [json.loads(x) for x in self.trace.read_text().splitlines()]
        last = [e for e in events if e["event"] == "counters"]
        return last[-1]["counters"] if last else {}

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the server's own shutdown left behind
        self.log.close()


def cmd_serve(args: argparse.Namespace) -> int:
    """Every server starts at once (idle engines wait on their input queue), then the runs go
    one at a time: vLLM's own vs the FCFS plug-in interleaved over repeats, then each load with
    every scheduler in turn, so drift of a shared machine spreads over all of them."""
    from tqdm import tqdm

    from sluice_vllm.policies import step_time_line

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    loads = [float(x) for x in args.rates.split(",")]
    names = ["vllm", "fcfs", *args.policy]
    results: dict[str, Any] = {
        "rates": loads,
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "policies": {n: {} for n in names},
    }
    servers = {
        name: Server(None if name == "vllm" else name, args.port + k, args.max_num_seqs, log_dir)
        for k, name in enumerate(names)
    }
    try:
        for server in tqdm(servers.values(), desc="servers up"):
            server.wait(args.start_timeout_s)

        def run(name: str, rate: float, seed: int) -> dict[str, Any]:
            trace = make_trace(rate, args.requests, seed)
            res, wall = asyncio.run(replay(servers[name].base, trace))
            return summarize(trace, res, wall)

        def save() -> None:
            if args.out:
                write_json(results, args.out, indent=1, quiet=True)

        rate = loads[len(loads) // 2]
        pairs = []
        for rep in tqdm(range(args.repeats), desc="vllm vs fcfs plug-in"):
            order = ["vllm", "fcfs"] if rep % 2 == 0 else ["fcfs", "vllm"]
            pairs.append({n: run(n, rate, seed=100 + rep) for n in order})
        results["identity"] = {"rate": rate, "runs": pairs}
        save()
        for r in loads:
            for rep in range(args.policy_repeats):  # every scheduler once per repeat, interleaved
                for name in tqdm(names, desc=f"rate {r} #{rep + 1}"):
                    m = run(name, r, seed=7 + rep)
                    results["policies"][name].setdefault(str(r), m)
                    results["policies"][name].setdefault(f"{r}_runs", []).append(m)
                save()
        for name in names[1:]:
            results["policies"][name]["plugin_counters"] = servers[name].counters()
        line = step_time_line(servers["fcfs"].counters())
        if line is not None:
            results["step_time_fit"] = {"base_ms": line.base_s * 1e3, "us_per_token": line.per_token_s * 1e6}
        save()
    finally:
        for server in servers.values():
            server.stop()
    report(results)
    return 0


def report(results: dict[str, Any]) -> None:
    runs = results["identity"]["runs"]
    thr = [r["fcfs"]["throughput_tok_s"] / r["vllm"]["throughput_tok_s"] for r in runs]
    tbt = [r["fcfs"]["tbt_p50_s"] / r["vllm"]["tbt_p50_s"] for r in runs]
    print(f"FCFS plug-in / vLLM's own: throughput {statistics.median(thr):.3f} ({min(thr):.3f}..{max(thr):.3f}), "
          f"TBT p50 {statistics.median(tbt):.3f} ({min(tbt):.3f}..{max(tbt):.3f})")  # fmt: skip
    rows = []
    for name, by_rate in results["policies"].items():
        for rate in results["rates"]:
            m = by_rate.get(str(rate))
            if m is None:
                continue
            rows.append(
                {
                    "policy": name,
                    "rate": rate,
                    "tok/s": m["throughput_tok_s"],
                    "TTFT p50/p99 s": f"{m['ttft_p50_s']:.2f}/{m['ttft_p99_s']:.2f}",
                    "TBT p50/p99 ms": f"{m['tbt_p50_s'] * 1e3:.1f}/{m['tbt_p99_s'] * 1e3:.1f}",
                    "norm s/tok": m["mean_norm_latency_s"],
                    "goodput": m["goodput_req_s"],
                    "ok": "y" if m["tokens_match"] and not m["failed"] else "n",
                }
            )
    formats = {"rate": "{:.1f}", "tok/s": "{:.0f}", "norm s/tok": "{:.4f}", "goodput": "{:.2f}"}
    print_table(rows, formats=formats, right=("TTFT p50/p99 s", "TBT p50/p99 ms"))


def main() -> int:
    p = benchmark_parser(__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--running", type=int, default=256)
    o.add_argument("--rounds", type=int, default=5)
    o.add_argument("--steps", type=int, default=200)
    o.add_argument("--policy", action="append", default=None)
    o.add_argument("--out")
    o.set_defaults(func=cmd_overhead)
    s = sub.add_parser("serve")
    s.add_argument("--rates", default="0.75,1.5,3", help="requests/s: three loads, the last past capacity")
    s.add_argument("--requests", type=int, default=30)
    s.add_argument("--repeats", type=int, default=3, help="interleaved vLLM-vs-FCFS-plug-in runs")
    s.add_argument("--max-num-seqs", type=int, default=4)
    s.add_argument(
        "--policy-repeats", type=int, default=1, help="runs of every scheduler at each load (seeds 7, 8, ...)"
    )
    s.add_argument("--policy", action="append", default=None)
    s.add_argument("--port", type=int, default=18200)
    s.add_argument("--start-timeout-s", type=float, default=1500, help="a shared machine starts engines slowly")
    s.add_argument("--log-dir", default="out/vllm_plugin", help="servers' logs and plug-in traces")
    s.add_argument("--out")
    s.set_defaults(func=cmd_serve)
    args = p.parse_args()
    if args.cmd == "overhead" and args.policy is None:
        args.policy = ["fcfs", "priority", "sarathi", "alise", "fastserve", "accelgen", "slo_class"]
    if args.cmd == "serve" and args.policy is None:
        args.policy = ["alise", "sarathi:budget=128", "fastserve", "accelgen", "priority", "slo_class"]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
