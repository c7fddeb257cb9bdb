"""Overload with SLOs: SLO-aware admission at its defaults against a hand sweep of the limits.

2 worker processes: `sluice worker --engine echo --echo-step-ms A --echo-token-ms B`, real
    gRPC workers that check every plan; a step sleeps A ms + B ms per scheduled token, the
    shape of a model's step cost (the tiny CPU model's steps on this shared 2-core machine
    vary too much between runs for a ratio; the emulated speed is what the scheduler
    measures and plans with either way)
the scheduler in this process (LiveScheduler + SchedulerServer), the load too: Poisson
    arrivals for --duration-s at a multiple of the workers' capacity, prompts and outputs
    drawn uniformly, every request with a TTFT and a TBT SLO (online)
capacity: the requests/s the two workers sustain at the largest batch whose step meets
    the TBT SLO (the line A + B x tokens), printed with the figures

per run:  admitted / refused (RESOURCE_EXHAUSTED, with the ErrorInfo reason), the share of
          admitted requests that met their SLO (TTFT and mean TBT), goodput = requests that
          met their SLO per second of arrivals
runs:     default    sluice's defaults (admission slo, max_num_seqs 256, max_waiting 256)
          no-admit   the defaults with --admission off (the behaviour the issue measured)
          sweep      --admission off with max_num_seqs x max_waiting by hand
          (interleaved round by round, --rounds times; medians and spreads over rounds)
then at --low-load x capacity: admission slo vs off (what admission refuses that the run
without it served within its SLO)
mixed:    online requests at --overload x capacity as above, and offline-class requests (no
          latency SLO) at --offline-load x capacity beside them, for the same seconds:
          queue      the defaults: offline requests wait in the offline queue and use the room
                     online ones leave idle, giving way to them (scheduler_service/core/offline.py)
          inline     --max-offline-waiting 0: offline requests queue as online ones do (the
                     behaviour before the offline queue)
          online     the online requests alone (what the offline ones cost them)
          per run: online admitted / refused, the share of admitted online requests meeting their
          SLO, online goodput; offline finished OK (all their tokens) of sent, how the rest ended,
          offline throughput (finished per second, from the first arrival to the last finish)

python benchmarks/overload.py [--overload 10] [--duration-s 10] [--rounds 2] [--phases ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
from tqdm import tqdm

from scheduler_service.core.admission import StepSpeed
from sluice.v1 import common_pb2, generation_pb2
from sluice_bench.fault_harness import spawn_worker_process, stack
from sluice_bench.options import benchmark_parser
from sluice_bench.report import write_json


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second (Poisson)
    duration_s: float
    prompt: tuple[int, int]  # uniform, inclusive
    output: tuple[int, int]
    ttft_ms: float
    tbt_ms: float
    seed: int


@dataclass(frozen=True)
class RunResult:
    name: str
    admitted: int
    refused: int
    met: int
    other: int  # ended with another status (there should be none)
    refusal_reasons: dict[str, int]
    ttft_p90_s: float
    tbt_mean_p90_s: float
    duration_s: float

    @property
    def attainment(self) -> float:
        return self.met / self.admitted if self.admitted else 0.0

    @property
    def goodput(self) -> float:
        return self.met / self.duration_s


def capacity(speed: StepSpeed, load: Load) -> tuple[float, int]:
    """Requests/s two workers sustain at the largest batch whose steady step meets the TBT SLO."""
    prompt = sum(load.prompt) / 2
    output = sum(load.output) / 2
    batch = speed.max_batch(load.tbt_ms / 1e3, prompt / output)
    step_s = speed.step_s(batch * (1 + prompt / output))
    return 2 * batch / output / step_s, batch


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Outcome:
    code: str = "OK"
    details: str = ""
    slo_met: bool = False
    ttft_s: float = 0.0
    mean_tbt_s: float = 0.0
    tokens: int = 0
    ended_at: float = 0.0  # the event loop's clock when the stream ended


async def _one(stub: Any, request: generation_pb2.GenerateRequest) -> Outcome:
    """One Generate stream to its end: the status, and the server's timings of its final message."""
    out = Outcome()
    try:
        async for message in stub.Generate(request):
            out.tokens += len(message.token_ids)
            if message.finish_reason:
                out.slo_met = message.timings.slo_met
                out.ttft_s, out.mean_tbt_s = message.timings.ttft_s, message.timings.mean_tbt_s
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    out.ended_at = asyncio.get_running_loop().time()
    return out


def _arrivals(rng: random.Random, load: Load, rate: float) -> list[tuple[float, int, int]]:
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= load.duration_s:
            return arrivals
        arrivals.append((t, rng.randint(*load.prompt), rng.randint(*load.output)))


async def _send(stub: Any, start: float, i: int, at: float, n_prompt: int, n_out: int, slo: Any) -> Outcome:
    """Request i of a run, sent at `start + at` on the event loop's clock."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + at - loop.time()))
    ids = common_pb2.TokenIds(ids=[1000 + (i * 131 + k) % 20000 for k in range(n_prompt)])
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    return await _one(stub, generation_pb2.GenerateRequest(token_ids=ids, sampling_params=sampling, slo=slo))


def _run_result(name: str, outcomes: list[Outcome], duration_s: float) -> RunResult:
    admitted = [o for o in outcomes if o.code == "OK"]
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    return RunResult(
        name,
        len(admitted),
        len(refused),
        sum(o.slo_met for o in admitted),
        len(outcomes) - len(admitted) - len(refused),
        dict(Counter(o.details.split(":", 1)[0][:60] for o in refused)),
        _percentile([o.ttft_s for o in admitted], 0.9),
        _percentile([o.mean_tbt_s for o in admitted], 0.9),
        duration_s,
    )


async def run_load(addresses: list[str], load: Load, name: str, **config: Any) -> RunResult:
    arrivals = _arrivals(random.Random(load.seed), load, load.rate)
    slo = common_pb2.SloSpec(ttft_ms=load.ttft_ms, tbt_ms=load.tbt_ms)
    cfg = {"num_gpu_blocks": 8192, "swap_space_gib": 0.01, **config}
    async with stack(addresses, **cfg) as s:
        start = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(*(_send(s.stub, start, i, *a, slo) for i, a in enumerate(arrivals)))
        await s.wait_idle(30)
    return _run_result(name, list(outcomes), load.duration_s)


@dataclass(frozen=True)
class MixedResult:
    name: str
    online: RunResult
    offline_sent: int
    offline_ok: int  # ended OK with every token asked for
    offline_codes: dict[str, int]
    offline_span_s: float  # first arrival to the last offline request's end

    @property
    def offline_throughput(self) -> float:
        return self.offline_ok / self.offline_span_s if self.offline_span_s > 0 else 0.0


async def run_mixed(
    addresses: list[str], load: Load, offline_rate: float, name: str, online_only: bool = False, **config: Any
) -> MixedResult:
    """Online requests (TTFT and TBT SLOs) at load.rate and offline-class ones at `offline_rate`,
    Poisson, for load.duration_s; every stream followed to its end."""
    rng = random.Random(load.seed)
    online = _arrivals(rng, load, load.rate)
    offline = [] if online_only else _arrivals(random.Random(load.seed + 7), load, offline_rate)
    slo = common_pb2.SloSpec(ttft_ms=load.ttft_ms, tbt_ms=load.tbt_ms)
    offline_slo = common_pb2.SloSpec(slo_class=common_pb2.SLO_CLASS_OFFLINE)
    cfg = {"num_gpu_blocks": 8192, "swap_space_gib": 0.01, **config}
    async with stack(addresses, **cfg) as s:
        start = asyncio.get_running_loop().time()
        outcomes = await asyncio.gather(
            *(_send(s.stub, start, i, *a, slo) for i, a in enumerate(online)),
            *(_send(s.stub, start, len(online) + i, *a, offline_slo) for i, a in enumerate(offline)),
        )
        await s.wait_idle(30)
    on, off = list(outcomes[: len(online)]), outcomes[len(online) :]
    finished = [o for o, a in zip(off, offline, strict=True) if o.code == "OK" and o.tokens == a[2]]
    return MixedResult(
        name,
        _run_result(name, on, load.duration_s),
        len(offline),
        len(finished),
        dict(Counter(o.code for o in off)),
        max((o.ended_at for o in finished), default=start) - start - (offline[0][0] if offline else 0.0),
    )


def mixed_summary(results: list[MixedResult]) -> dict[str, Any]:
    out = {"online": summary([r.online for r in results])}
    if results[0].offline_sent:
        thr = [r.offline_throughput for r in results]
        out["offline"] = {
            "sent": [r.offline_sent for r in results],
            "finished_ok": [r.offline_ok for r in results],
            "all_finished": all(r.offline_ok == r.offline_sent for r in results),
            "codes": dict(sum((Counter(r.offline_codes) for r in results), Counter())),
            "throughput_req_s": round(statistics.median(thr), 2),
            "throughput_spread": [round(min(thr), 2), round(max(thr), 2)],
            "span_s": [round(r.offline_span_s, 2) for r in results],
        }
    return out


def summary(results: list[RunResult]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    def spread(values: list[float]) -> list[float]:
        return [round(min(values), 3), round(max(values), 3)]

    att = [r.attainment for r in results]
    good = [r.goodput for r in results]
    return {
        "admitted": [r.admitted for r in results],
        "refused": [r.refused for r in results],
        "other_status": sum(r.other for r in results),
        "attainment_admitted": med(att),
        "attainment_spread": spread(att),
        "goodput_req_s": med(good),
        "goodput_spread": spread(good),
        "ttft_p90_s": med([r.ttft_p90_s for r in results]),
        "tbt_mean_p90_s": med([r.tbt_mean_p90_s for r in results]),
        "refusal_reasons": dict(sum((Counter(r.refusal_reasons) for r in results), Counter())),
    }


async def overload_phase(args: argparse.Namespace, addresses: list[str], base: Load, cap: float) -> dict[str, Any]:
    """Online requests at --overload x capacity: the defaults, admission off, and the hand sweep."""
    variants: list[tuple[str, dict[str, Any]]] = [("default", {}), ("no-admit", {"admission": "off"})]
    for seqs in args.sweep_seqs:
        for waiting in args.sweep_waiting:
            variants.append(
                (f"seqs={seqs},waiting={waiting}", {"admission": "off", "max_num_seqs": seqs, "max_waiting": waiting})
            )
    high = Load(args.overload * cap, **{k: v for k, v in base.__dict__.items() if k != "rate"})
    results: dict[str, list[RunResult]] = {name: [] for name, _ in variants}
    bar = tqdm(total=args.rounds * len(variants), desc=f"{args.overload:g}x overload", unit="run")
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for name, config in order:
            load = Load(high.rate, high.duration_s, high.prompt, high.output, high.ttft_ms, high.tbt_ms, args.seed + r)
            results[name].append(await run_load(addresses, load, name, **config))
            bar.update(1)
            res = results[name][-1]
            bar.write(
                f"round {r} {name}: admitted {res.admitted} refused {res.refused} "
                f"attainment {res.attainment:.3f} goodput {res.goodput:.2f}/s"
            )
    bar.close()
    over = {name: summary(rs) for name, rs in results.items()}
    best_name = max((n for n in over if n.startswith("seqs=")), key=lambda n: over[n]["goodput_req_s"])
    return {
        "rate_req_s": round(high.rate, 1),
        "runs": over,
        "best_sweep": best_name,
        "default_goodput_vs_best_sweep": round(over["default"]["goodput_req_s"] / over[best_name]["goodput_req_s"], 3),
        "default_attainment": over["default"]["attainment_admitted"],
    }


async def low_phase(args: argparse.Namespace, addresses: list[str], base: Load, cap: float) -> dict[str, Any]:
    """Online requests at --low-load x capacity: admission slo vs off."""
    low = Load(args.low_load * cap, **{k: v for k, v in base.__dict__.items() if k != "rate"})
    low_runs: dict[str, list[RunResult]] = {"slo": [], "off": []}
    for r in tqdm(range(args.rounds), desc=f"{args.low_load:g}x load", unit="round"):
        for mode in ("slo", "off") if r % 2 == 0 else ("off", "slo"):
            load = Load(
                low.rate, 2 * low.duration_s, low.prompt, low.output, low.ttft_ms, low.tbt_ms, args.seed + 100 + r
            )
            low_runs[mode].append(await run_load(addresses, load, mode, admission=mode))
    return {
        "rate_req_s": round(low.rate, 2),
        "admission_slo": summary(low_runs["slo"]),
        "admission_off": summary(low_runs["off"]),
    }


async def mixed_phase(args: argparse.Namespace, addresses: list[str], base: Load, cap: float) -> dict[str, Any]:
    """Online requests at --overload x capacity with offline-class ones beside them (module docstring)."""
    variants: list[tuple[str, dict[str, Any]]] = [
        ("queue", {}),
        ("inline", {"max_offline_waiting": 0}),
        ("online", {"online_only": True}),
    ]
    offline_rate = args.offline_load * cap
    runs: dict[str, list[MixedResult]] = {name: [] for name, _ in variants}
    for r in tqdm(range(args.rounds), desc="mixed", unit="round"):
        for name, config in variants if r % 2 == 0 else list(reversed(variants)):
            load = Load(
                args.overload * cap, base.duration_s, base.prompt, base.output, base.ttft_ms, base.tbt_ms, args.seed + r
            )
            res = await run_mixed(addresses, load, offline_rate, name, **config)
            runs[name].append(res)
            tqdm.write(
                f"round {r} {name}: online admitted {res.online.admitted} attainment {res.online.attainment:.3f} "
                f"goodput {res.online.goodput:.2f}/s; offline {res.offline_ok}/{res.offline_sent} ok "
                f"{res.offline_throughput:.2f}/s"
            )
    return {
        "online_rate_req_s": round(args.overload * cap, 1),
        "offline_rate_req_s": round(offline_rate, 1),
        "runs": {name: mixed_summary(rs) for name, rs in runs.items()},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    speed = StepSpeed(args.step_ms / 1e3, args.token_ms / 1e3)
    base = Load(1.0, args.duration_s, (16, 80), (8, 24), args.ttft_ms, args.tbt_ms, args.seed)
    cap, batch = capacity(speed, base)
    extra = ["--echo-token-ms", str(args.token_ms)]
    workers = [await spawn_worker_process(w, step_ms=args.step_ms, extra=extra) for w in range(2)]
    addresses = [w.address for w in workers]
    figures: dict[str, Any] = {
        "emulated_step": f"{args.step_ms:g} ms + {args.token_ms:g} ms/token",
        "slo_ms": {"ttft": args.ttft_ms, "tbt": args.tbt_ms},
        "capacity_req_s": round(cap, 2),
        "tbt_batch_bound": batch,
    }
    try:
        if "overload" in args.phases:
            figures["overload"] = await overload_phase(args, addresses, base, cap)
        if "low" in args.phases:
            figures["low_load"] = await low_phase(args, addresses, base, cap)
        if "mixed" in args.phases:
            figures["mixed"] = await mixed_phase(args, addresses, base, cap)
    finally:
        for w in workers:
            w.stop()
    return figures


def plot(figures: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = figures["overload"]["runs"]
    names = list(runs)
    goodput = [runs[n]["goodput_req_s"] for n in names]
    attainment = [runs[n]["attainment_admitted"] for n in names]
    colors = ["tab:green" if n == "default" else "tab:red" if n == "no-admit" else "tab:gray" for n in names]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    top.bar(names, goodput, color=colors)
    top.set_ylabel("goodput (req/s meeting SLO)")
    top.set_title(
        f"{figures['overload']['rate_req_s']:g} req/s ({figures['capacity_req_s']:g} req/s capacity), "
        f"emulated step {figures['emulated_step']}, SLO TTFT {figures['slo_ms']['ttft']:g} ms / TBT "
        f"{figures['slo_ms']['tbt']:g} ms\ngreen: defaults (SLO-aware admission); red: admission off at the "
        "default limits; grey: admission off, limits set by hand",
        fontsize=9,
    )
    bottom.bar(names, attainment, color=colors)
    bottom.axhline(0.9, color="black", linewidth=0.8, linestyle="--")
    bottom.set_ylabel("SLO met, of admitted")
    bottom.set_ylim(0, 1)
    plt.setp(bottom.get_xticklabels(), rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--step-ms", type=float, default=10.0, help="emulated step time, fixed part")
    p.add_argument("--token-ms", type=float, default=2.0, help="emulated step time per scheduled token")
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tbt-ms", type=float, default=200.0)
    p.add_argument("--overload", type=float, default=10.0, help="arrival rate as a multiple of capacity")
    p.add_argument("--low-load", type=float, default=0.5)
    p.add_argument("--offline-load", type=float, default=1.0, help="mixed: offline arrivals as a multiple of capacity")
    p.add_argument("--phases", nargs="+", choices=("overload", "low", "mixed"), default=["overload", "low", "mixed"])
    p.add_argument("--duration-s", type=float, default=10.0, help="seconds of arrivals per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep-seqs", type=int, nargs="+", default=[8, 12, 16, 20, 24])
    p.add_argument("--sweep-waiting", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--plot", help="write a PNG of goodput and attainment per configuration here")
    args = p.parse_args()
    figures = asyncio.run(main_async(args))
    print(json.dumps(figures, indent=2))
    if args.plot and "overload" in figures:
        plot(figures, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        write_json(figures, args.json, indent=2, quiet=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
