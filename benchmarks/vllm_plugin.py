"""Sluice's policies inside vLLM (`sluice_vllm`), measured.

    overhead   the plug-in's added time per step at 256 running requests: vLLM's own
               Scheduler and the plug-in's (each policy), no model, the same requests,
               interleaved rounds (target: under 0.5 ms added)
    serve      the same trace through `vllm serve` (a small dummy-weight Llama on CPU) with
               vLLM's own scheduler and with each plug-in policy, one streaming OpenAI client:
               the capacity (a burst), then TTFT/TBT p50/p99, mean normalized latency, goodput
               under SLOs at three loads (shares of that capacity, the last past it); FCFS
               plug-in vs vLLM's own scheduler at saturation, interleaved over repeats (target:
               within 2% in throughput and TBT); each policy vs FCFS in mean normalized latency
               (target for ALISE: 1.3x); Sluice's simulator's median JCT of every run, priced by
               the FCFS engine's own steps during the capacity burst (target: within 15%)

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
import gzip
import json
import os
import random
import shutil
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

ROOT = Path(__file__).resolve().parents[1]

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
MAX_NUM_BATCHED_TOKENS = 1024
KV_BYTES = 256 * 2**20
SERVED_NAME = "sluice-bench"
# NOTE: a small Llama (4 layers of 384) rather than the tests' tiny one: with the tiny one a step
# costs less than streaming its tokens, so the API server and the client, not the engine, set
# the capacity; here the engine does, as on a GPU, and the engine is what the simulator models.
SMALL_MODEL = str(ROOT / "tests" / "data" / "small-llama-vllm")
SERVE_FLAGS = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
    "--kv-cache-memory-bytes", str(KV_BYTES), "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--no-enable-prefix-caching",
    "--served-model-name", SERVED_NAME,
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
    """Poisson arrivals at `rate` requests/s; rate 0: every request at once (a burst)."""
    rng = random.Random(seed)
    t = 0.0
    items = []
    for i in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
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
        "model": SERVED_NAME,
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
    # NOTE: a loaded API server merges several tokens into one streamed chunk (gaps of 0), so a
    # request's mean gap, (last - first) / (tokens - 1), is the TBT that survives the merging
    mean_tbt = [(r.token_times[-1] - r.token_times[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
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
        "request_tbt_p50_s": pct(mean_tbt, 50),
        "mean_norm_latency_s": statistics.mean(norm) if norm else float("nan"),
        "mean_norm_latency_short_s": statistics.mean(short) if short else float("nan"),
        "goodput_req_s": good / wall_s,
        "slo_attainment": good / len(results),
        "wall_s": wall_s,
        # per request: sent (monotonic s, the engine's clock too), prompt, output, priority, JCT
        "sent": [[r.rid, r.sent, len(by_id[r.rid].prompt), by_id[r.rid].out, by_id[r.rid].priority,
                  r.token_times[-1] - r.sent] for r in ok],
    }  # fmt: skip


# ---------------------------------------------------------------------------- servers


class Server:
    """`vllm serve` through the project's launcher: vLLM's own scheduler (policy None) or the plug-in."""

    def __init__(
        self, model: str, policy: str | None, port: int, max_num_seqs: int, log_dir: Path, step_log: bool = False
    ) -> None:
        self.policy = policy
        self.base = f"http://127.0.0.1:{port}"
        self.trace = log_dir / f"trace-{port}.jsonl"
        self.step_log = log_dir / f"steps-{port}.jsonl"
        self.step_log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "sluice_vllm.launcher", "serve", model, *SERVE_FLAGS]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if policy is not None:
            cmd += ["--scheduler-cls", "sluice_vllm.scheduler.SluiceScheduler"]
            env |= {"SLUICE_VLLM_POLICY": policy, "SLUICE_VLLM_TRACE": str(self.trace)}
            if step_log:
                env["SLUICE_VLLM_STEP_LOG"] = str(self.step_log)
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

    def cpu_s(self) -> float:
        """CPU seconds of the server's processes so far (API server, engine core, their children)."""
        import psutil

        total = 0.0
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = proc.cpu_times()
                    total += t.user + t.system
        return total

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
    one at a time: a burst on the FCFS plug-in measures the engine's capacity (and is the step
    profile the simulator prices with); vLLM's own vs the FCFS plug-in at saturation, interleaved
    over repeats; then each load (a share of that capacity) with every scheduler in turn, so
    drift of a shared machine spreads over all of them; last, the simulator's prediction of
    every run."""
    from tqdm import tqdm

    from sluice_vllm.policies import step_time_line

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ["vllm", "fcfs", *args.policy]
    results: dict[str, Any] = {
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "policies": {n: {} for n in names},
    }
    servers = {
        name: Server(
            args.model, None if name == "vllm" else name, args.port + k, args.max_num_seqs, log_dir, name == "fcfs"
        )
        for k, name in enumerate(names)
    }
    try:
        for server in tqdm(servers.values(), desc="servers up"):
            server.wait(args.start_timeout_s)

        def run(name: str, rate: float, seed: int) -> dict[str, Any]:
            trace = make_trace(rate, args.requests, seed)
            cpu = servers[name].cpu_s()
            started = time.monotonic()
            res, wall = asyncio.run(replay(servers[name].base, trace))
            m = summarize(trace, res, wall)
            tokens = sum(r.tokens for r in res)
            m["cpu_s_per_token"] = (servers[name].cpu_s() - cpu) / max(tokens, 1)
            m["window"] = [started, time.monotonic()]
            m["seed"] = seed  # the trace's: the prediction rebuilds each request's hints from it
            return m

        def save() -> None:
            if args.out:
                write_json(results, args.out, indent=1, quiet=True)

        calibration = run("fcfs", 0.0, seed=99)  # a burst: the engine's capacity and its step profile
        capacity = args.requests / calibration["wall_s"]
        results["capacity"] = {"req_s": capacity, "run": calibration}
        loads = [float(x) for x in args.rates.split(",")] if args.rates else [f * capacity for f in args.loads]
        results["rates"] = loads
        print(f"capacity (FCFS plug-in, a burst of {args.requests}): {capacity:.2f} req/s; loads {loads}")
        pairs = []
        for rep in tqdm(range(args.repeats), desc="vllm vs fcfs plug-in at saturation"):
            order = ["vllm", "fcfs"] if rep % 2 == 0 else ["fcfs", "vllm"]
            pairs.append({n: run(n, 0.0, seed=100 + rep) for n in order})
        results["identity"] = {"rate": "burst", "runs": pairs}
        save()
        for r in loads:
            for rep in range(args.policy_repeats):  # every scheduler once per repeat, interleaved
                for name in tqdm(names, desc=f"rate {r:.2f} #{rep + 1}"):
                    m = run(name, r, seed=7 + rep)
                    results["policies"][name].setdefault(f"{r}_runs", []).append(m)
                save()
        for name in names[1:]:
            results["policies"][name]["plugin_counters"] = servers[name].counters()
        line = step_time_line(servers["fcfs"].counters())
        if line is not None:
            results["step_time_fit"] = {"base_ms": line.base_s * 1e3, "us_per_token": line.per_token_s * 1e6}
        time.sleep(1.0)  # the engine writes its step log when it runs out of requests
        if args.out:  # NOTE: kept beside the results, so the prediction can be redone offline
            with servers["fcfs"].step_log.open("rb") as src, gzip.open(f"{args.out}.steps.jsonl.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        results["prediction"] = predict(results, servers["fcfs"].step_log, args)
        save()
    finally:
        for server in servers.values():
            server.stop()
    report(results)
    return 0


def predict(results: dict[str, Any], step_log: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's median JCT for every run (vLLM's loop with the run's plug-in policy,
    the requests with the hints they carried, sluice_bench/vllm_plugin_emulation.py), priced
    two ways: by a profile fitted on the FCFS engine's steps during the calibration burst only
    ("burst"), and by that profile at the engine's speed of the run's own round ("round": the
    median measured / priced step time of the FCFS plug-in's run at the same load and seed, a
    few minutes and other servers' runs away from the burst; the other schedulers' runs of the
    round are held out of it, the FCFS run's own step times set its level)."""
    from sluice_bench.vllm_plugin_predict import (
        SentRequest,
        at_speed,
        busy_samples,
        fit_profile,
        median_error,
        model_spec,
        predict_jct,
        read_steps,
        speed_level,
    )

    steps = read_steps(step_log)
    start, end = results["capacity"]["run"]["window"]
    samples = busy_samples(steps, start, end)
    spec = model_spec(Path(args.model), MAX_MODEL_LEN)
    cost_model = fit_profile(samples, spec, BLOCK_SIZE)
    fit = cost_model.fit_report()
    out: dict[str, Any] = {"profile_steps": len(samples), "profile_mape": fit.mape, "runs": [], "speed_levels": {}}
    shape = {
        "num_blocks": KV_BYTES // (spec.kv_bytes_per_token_per_gpu * BLOCK_SIZE),
        "block_size": BLOCK_SIZE,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
    }
    fcfs_runs = results["policies"]["fcfs"]
    for rate in results["rates"]:
        for k, fcfs in enumerate(fcfs_runs.get(f"{rate}_runs", [])):
            slos = {item.rid: slo_of(item) for item in make_trace(rate, args.requests, fcfs["seed"])}  # as sent
            level = speed_level(cost_model, busy_samples(steps, *fcfs["window"]))
            out["speed_levels"][f"{rate}#{k}"] = level
            for name, by_rate in results["policies"].items():
                runs = by_rate.get(f"{rate}_runs", [])
                if k >= len(runs):
                    continue
                m = runs[k]
                sent = [SentRequest(rid, t, p, o, pr, slos[rid]) for rid, t, p, o, pr, _ in m["sent"]]
                measured = {rid: jct for rid, *_, jct in m["sent"]}
                live, sim, err = median_error(measured, predict_jct(name, sent, cost_model, **shape))
                _, sim_round, err_round = median_error(
                    measured, predict_jct(name, sent, at_speed(cost_model, level), **shape)
                )
                run = {"policy": name, "rate": rate, "repeat": k, "live_jct_p50_s": live, "sim_jct_p50_s": sim}
                out["runs"].append(
                    run | {"error": err, "sim_jct_p50_s_round": sim_round, "error_round": err_round, "speed": level}
                )
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def report(results: dict[str, Any]) -> None:
    runs = results["identity"]["runs"]

    def ratios(key: str) -> list[float]:
        return [r["fcfs"][key] / r["vllm"][key] for r in runs]

    print(f"capacity {results['capacity']['req_s']:.2f} req/s; FCFS plug-in / vLLM's own at saturation "
          f"(median, range of {len(runs)}): throughput {spread(ratios('throughput_tok_s'))}, "
          f"request TBT p50 {spread(ratios('request_tbt_p50_s'))}, "
          f"server CPU per token {spread(ratios('cpu_s_per_token'))}")  # fmt: skip
    rows = []
    fcfs = results["policies"]["fcfs"]
    for name, by_rate in results["policies"].items():
        for rate in results["rates"]:
            ms = by_rate.get(f"{rate}_runs")
            if not ms:
                continue
            mean = {k: statistics.mean(m[k] for m in ms) for k in ms[0] if isinstance(ms[0][k], float)}
            pairs = zip(fcfs[f"{rate}_runs"], ms, strict=True)  # the same seeds
            vs = [f["mean_norm_latency_s"] / m["mean_norm_latency_s"] for f, m in pairs]
            rows.append(
                {
                    "policy": name,
                    "req/s": rate,
                    "tok/s": mean["throughput_tok_s"],
                    "TTFT p50/p99 s": f"{mean['ttft_p50_s']:.2f}/{mean['ttft_p99_s']:.2f}",
                    "TBT p50/p99 ms": f"{mean['request_tbt_p50_s'] * 1e3:.1f}/{mean['tbt_p99_s'] * 1e3:.0f}",
                    "norm ms/tok": mean["mean_norm_latency_s"] * 1e3,
                    "FCFS/this": f"{statistics.median(vs):.2f} ({min(vs):.2f}..{max(vs):.2f})",
                    "goodput": mean["goodput_req_s"],
                    "ok": "y" if all(m["tokens_match"] and not m["failed"] for m in ms) else "n",
                }
            )
    formats = {"req/s": "{:.2f}", "tok/s": "{:.0f}", "norm ms/tok": "{:.1f}", "goodput": "{:.2f}"}
    print_table(rows, formats=formats, right=("TTFT p50/p99 s", "TBT p50/p99 ms", "FCFS/this"))
    pred = results.get("prediction")
    if pred:
        print(f"simulator priced by {pred['profile_steps']} steps of the calibration burst "
              f"(fit error {pred['profile_mape']:.1%}):")  # fmt: skip
        cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
        for r in pred["runs"]:
            cells.setdefault((r["policy"], r["rate"]), []).append(r)
        table = [
            {
                "policy": p,
                "req/s": rate,
                "live JCT p50 s": statistics.mean(r["live_jct_p50_s"] for r in rs),
                "sim JCT p50 s": statistics.mean(r["sim_jct_p50_s"] for r in rs),
                "error": ", ".join(f"{r['error']:.1%}" for r in rs),
                "sim at round speed": statistics.mean(r["sim_jct_p50_s_round"] for r in rs),
                "error, round speed": ", ".join(f"{r['error_round']:.1%}" for r in rs),
            }
            for (p, rate), rs in cells.items()
        ]
        formats = {k: "{:.2f}" for k in ("req/s", "live JCT p50 s", "sim JCT p50 s", "sim at round speed")}
        print_table(table, formats=formats)
        levels = ", ".join(f"{k} {v:.2f}" for k, v in pred["speed_levels"].items())
        print(f"engine speed of each round against the burst (measured / priced step time): {levels}")
        for key, label in (("error", "burst profile"), ("error_round", "burst profile at the round's speed")):
            errors = [r[key] for r in pred["runs"]]
            print(f"median JCT error over {len(errors)} runs, {label}: median {statistics.median(errors):.1%}, "
                  f"within 15%: {sum(e <= 0.15 for e in errors)}/{len(errors)}")  # fmt: skip


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
    s.add_argument(
        "--loads",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.5, 0.9, 1.5],
        help="arrival rates as shares of the capacity a burst measures first (the last past it)",
    )
    s.add_argument("--rates", help="absolute requests/s instead of --loads")
    s.add_argument("--requests", type=int, default=40)
    s.add_argument("--repeats", type=int, default=4, help="interleaved vLLM-vs-FCFS-plug-in runs at saturation")
    s.add_argument("--max-num-seqs", type=int, default=4)
    s.add_argument("--model", default=SMALL_MODEL, help="a model directory (config.json; dummy weights)")
    s.add_argument(
        "--policy-repeats", type=int, default=2, help="runs of every scheduler at each load (seeds 7, 8, ...)"
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
