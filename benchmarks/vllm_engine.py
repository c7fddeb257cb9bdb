"""vLLM alone against Sluice's scheduler driving vLLM's model runner, and against our torch engine.

    (a) vllm     vLLM's own engine in this process: LLM.generate (offline); its LLMEngine stepped
                 with requests added at their Poisson arrival times (online)
    (b) sluice+vllm   `sluice serve --engine vllm --policy vllm --workers 1` (a scheduler process, a
                 worker process hosting vLLM's worker and model runner), over gRPC
    (c) sluice+torch  `sluice serve --engine torch --policy vllm --workers 1`
    vllm-serve   `vllm serve` (the CPU build through sluice_vllm.launcher), online through its
                 OpenAI HTTP API: (a) as its users serve it
    sluice+vllm-http  (b) through Sluice's OpenAI gateway (`sluice serve --http-port 0`), the same
                 HTTP client as vllm-serve: the whole serving stack against vLLM's

Same requests (seeded prompt and output lengths, random token ids, EOS ignored, greedy), one
torch thread in every engine, the same KV blocks (vLLM's plus its null block) and block size.
The three run in turns, round after round, so drift on a shared machine falls on all alike;
each metric is reported per round and as the ratio to (a) within the round.

    python -m benchmarks.vllm_engine --model tiny-llama --rounds 3 --json out.json

`--baseline DIR` (a checkout of another revision, `git worktree add DIR REV`) also runs (b) from
that tree, as `sluice+vllm@baseline`, in the same turns, and reports this tree's (b) over it round
by round: a change to the worker or scheduler measured against the tree before it, side by side.
`--pin` gives each model runner a core of its own: (b)'s worker (`--worker-cpus`) and (a) on the
last core, (b)'s scheduler and this client on the others. Offline rounds also report CPU per
output token and the share of the wall time the measured process ran (their product with tok/s).

Without `--pin`, (b) and (c) run as `sluice serve` starts them by default (its automatic CPU
placement, services/placement.py, included) and (a) and this client unpinned. Variants of (b)
and (c), run in the same turns and reported as a ratio to the plain engine round by round
(suffixes combine, as in sluice+vllm@no-auto-pin@serve-threads):

    @no-auto-pin     `sluice serve --no-auto-pin`: every process on every CPU
    @serve-threads   no `--worker-threads 1`: the worker's torch threads as `sluice serve`
                     picks them (its cores), not one like (a)'s
    @worker-only     `--worker-cpus LAST`: the worker pinned to the last core, the scheduler and
                     the rest on every CPU (the placement without its scheduler side)
    @remote-client   `sluice serve` as by default, this client's thread kept off the cores its
                     worker was placed on while it runs (as a client on another machine would be)

    python -m benchmarks.vllm_engine --rounds 5 --online-rounds 0 --engines vllm,sluice+vllm,sluice+vllm@no-auto-pin

Offline: all requests at once; output tokens/s from the first request sent to the last token.
Online: Poisson arrivals at --rate; TBT is every gap between two tokens of a request, E2E the
arrival to the last token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

ROOT = Path(__file__).resolve().parents[1]
# NOTE: the environment as this command was started, for every server it launches: building (a)
# in this process has vLLM set about twenty variables in os.environ (LD_PRELOAD of torch's libgomp,
# VLLM_ENABLE_V1_MULTIPROCESSING=0, inductor settings), which a server started after it would
# inherit, so that `vllm serve` ran its engine core in its API server's process, unlike as its users run it
LAUNCH_ENV = dict(os.environ)
LISTENING = re.compile(r"sluice scheduler listening on ([\d.]+):(\d+)")
GATEWAY = re.compile(r"sluice OpenAI API at (http://[\d.]+:\d+/v1)")
HTTP_ENGINES = ("vllm-serve", "sluice+vllm-http")  # online only: served over OpenAI HTTP
BASELINE = "@baseline"  # suffix of an engine run from the --baseline tree
NO_AUTO_PIN = "@no-auto-pin"  # suffix of (b) or (c) run with `sluice serve --no-auto-pin`
SERVE_THREADS = "@serve-threads"  # suffix of (b) or (c) run without `--worker-threads 1`
WORKER_ONLY = "@worker-only"  # suffix of (b) or (c) run with the worker alone pinned, to the last core
REMOTE_CLIENT = "@remote-client"  # suffix of (b) or (c) whose client stays off its worker's cores
VARIANTS = (BASELINE, NO_AUTO_PIN, SERVE_THREADS, WORKER_ONLY, REMOTE_CLIENT)
BLOCK = 32


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass
class Trace:
    """When each token of one request arrived (perf_counter), and when the request was sent."""

    sent: float
    tokens: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


def make_jobs(n: int, vocab: int, rate: float | None, seed: int) -> list[Job]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        if rate:
            t += rng.expovariate(rate)
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(16, 256))]
        out.append(Job(prompt, rng.randint(16, 128), t))
    return out


def summarize(traces: Sequence[Trace], start: float | None = None) -> dict[str, float]:
    """Rates over [start, last token]; start defaults to the first request sent."""
    start = min(t.sent for t in traces) if start is None else start
    end = max(t.tokens[-1] for t in traces)
    gaps = [b - a for t in traces for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    return {
        "output_tok_s": sum(len(t.tokens) for t in traces) / (end - start),
        "tbt_p50_ms": 1e3 * statistics.median(gaps),
        "tbt_p90_ms": 1e3 * statistics.quantiles(gaps, n=10)[-1],
        "ttft_p50_ms": 1e3 * statistics.median(t.tokens[0] - t.sent for t in traces),
        "e2e_mean_s": statistics.fmean(t.tokens[-1] - t.sent for t in traces),
    }


# ---------------------------------------------------------------- (a) vLLM alone


class VllmAlone:
    def __init__(self, model_dir: str, dtype: str, num_blocks: int, compile_model: bool) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # NOTE: one process, as our worker
        import torch
        from vllm import LLM

        from sluice.contract.limits import DEFAULT_MAX_NUM_SEQS, token_budget

        torch.set_num_threads(1)
        # NOTE: Sluice's batch limits (its scheduler's and its vLLM worker's), not the smaller
        # token budget vLLM's CPU platform picks for LLM (4096): the same step sizes on both sides.
        max_model_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
        self.llm = LLM(
            model=model_dir, load_format="dummy", dtype=dtype, skip_tokenizer_init=True, block_size=BLOCK,
            gpu_memory_utilization=0.2, num_gpu_blocks_override=num_blocks + 1, enforce_eager=not compile_model,
            seed=0, enable_prefix_caching=False, max_num_seqs=DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens=token_budget(None, max_model_len),
        )  # fmt: skip

    def params(self, job: Job) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True, detokenize=False)

    def offline(self, jobs: Sequence[Job]) -> dict[str, float]:
        cpu, start = time.process_time(), time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": j.prompt} for j in jobs], [self.params(j) for j in jobs],
                                 use_tqdm=False)  # fmt: skip
        end = time.perf_counter()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"output_tok_s": tokens / (end - start), "cpu_ms_per_token": 1e3 * (time.process_time() - cpu) / tokens}

    def online(self, jobs: Sequence[Job]) -> dict[str, float]:
        engine = self.llm.llm_engine
        traces: dict[str, Trace] = {}
        start = time.perf_counter()
        pending = list(enumerate(jobs))
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and pending[0][1].arrival_s <= now:
                i, job = pending.pop(0)
                traces[str(i)] = Trace(time.perf_counter())
                engine.add_request(str(i), {"prompt_token_ids": job.prompt}, self.params(job))
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0][1].arrival_s - (time.perf_counter() - start)))
                continue
            for out in engine.step():
                trace = traces[out.request_id]
                stamp = time.perf_counter()
                trace.tokens += [stamp] * (len(out.outputs[0].token_ids) - len(trace.tokens))
        return summarize(list(traces.values()), start)


# ---------------------------------------------------------------- (b), (c) through sluice serve


class SluiceServe:
    def __init__(
        self,
        engine: str,
        model: str,
        dtype: str,
        num_blocks: int,
        compile_model: bool,
        policy: str = "vllm",
        http: bool = False,
        root: Path = ROOT,
        extra: Sequence[str] = (),
        one_thread: bool = True,
    ) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", "--port", "0", "--workers", "1", "--engine", engine]
        cmd += ["--http-port", "0"] if http else []
        cmd += ["--model", model, "--dtype", dtype, "--num-gpu-blocks", str(num_blocks)]
        cmd += ["--worker-threads", "1"] if one_thread else []
        cmd += ["--policy", policy, "--no-start-predictor", "--connect-timeout-s", "300"]
        cmd += [] if compile_model else ["--no-vllm-compile"]
        cmd += extra
        env = {k: v for k, v in LAUNCH_ENV.items() if not k.startswith("SLUICE_")}
        self.engine = engine
        self.proc = subprocess.Popen(
            cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
        )
        assert self.proc.stdout is not None
        self.address = self.base_url = ""
        for line in self.proc.stdout:
            if match := LISTENING.search(line):
                self.address = f"{match.group(1)}:{match.group(2)}"
            if match := GATEWAY.search(line):
                self.base_url = match.group(1)
            if self.address and (self.base_url or not http):
                break
        else:
            raise RuntimeError(f"sluice serve --engine {engine} exited ({self.proc.wait()}) before listening")
        self.http = http

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def run(self, jobs: Sequence[Job], online: bool) -> dict[str, float]:
        worker = self.worker_pid()
        cpu = process_cpu_s(worker) if worker else 0.0
        if self.http:
            traces = asyncio.run(http_traces(self.base_url, None, jobs, online, f"{self.engine}-{time.time()}"))
        else:
            traces = asyncio.run(self.traces(jobs, online))
        stats = summarize(traces)
        if online:
            return stats
        tokens = sum(len(t.tokens) for t in traces)
        cpu_ms = 1e3 * (process_cpu_s(worker) - cpu) / tokens if worker else float("nan")
        return {"output_tok_s": stats["output_tok_s"], "cpu_ms_per_token": cpu_ms}

    def worker_cpus(self) -> list[int]:
        """The CPUs the worker process may run on (the kernel's answer), for the record."""
        pid = self.worker_pid()
        return sorted(os.sched_getaffinity(pid)) if pid else []

    def worker_pid(self) -> int | None:
        """The worker process under `sluice serve` (its child, or a launcher's), on Linux."""
        stack = [self.proc.pid]
        while stack:
            pid = stack.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                return None
            for child in map(int, children):
                try:
                    if b"worker" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                        return child
                except OSError:
                    continue
                stack.append(child)
        return None

    async def traces(self, jobs: Sequence[Job], online: bool) -> list[Trace]:
        import grpc

        from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            start = time.perf_counter()

            async def one(i: int, job: Job) -> Trace:
                if online:
                    await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
                trace = Trace(time.perf_counter())
                request = generation_pb2.GenerateRequest(
                    request_id=f"{self.engine}-{start}-{i}",
                    token_ids=common_pb2.TokenIds(ids=job.prompt),
                    sampling_params=common_pb2.SamplingParams(
                        temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True
                    ),
                )
                async for message in stub.Generate(request):
                    stamp = time.perf_counter()
                    trace.tokens += [stamp] * len(message.token_ids)
                    trace.ids += message.token_ids
                return trace

            return list(await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs))))


# ---------------------------------------------------------------- over OpenAI HTTP


async def http_traces(base_url: str, model: str | None, jobs: Sequence[Job], online: bool, tag: str) -> list[Trace]:
    """The jobs sent to an OpenAI-compatible server by the bench's own client (streamed
    completions, token-id prompts, greedy, EOS ignored; `return_token_ids` so a server without a
    tokenizer still reports each token in its own chunk)."""
    from scheduler_service.core.slo import NO_SLO
    from scheduler_service.loadgen.openai_backend import OpenAIBench
    from scheduler_service.loadgen.requests import BenchRequest, RequestRecord

    async with OpenAIBench(base_url, model=model, token_ids=True) as bench:
        await bench.describe(max_model_len=4096)
        start = time.perf_counter()

        async def one(i: int, job: Job) -> Trace:
            if online:
                await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
            request = BenchRequest(f"{tag}-{i}", job.arrival_s, tuple(job.prompt), len(job.prompt), job.max_tokens,
                                   NO_SLO, ignore_eos=True)  # fmt: skip
            record = RequestRecord(request)
            t0 = time.perf_counter()
            await bench.send(record, t0, timeout=600.0)
            if record.error_code:
                raise RuntimeError(f"{base_url}: request {i} failed: {record.error_code} {record.message}")
            return Trace(t0, [t0 + t for t in record.token_times])

        return list(await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs))))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServe:
    """`vllm serve` of the same model, KV blocks, block size and one compute thread (its engine
    core bound to the last CPU), its default (FCFS) scheduler, prefix caching off as in (a)."""

    def __init__(self, model_dir: str, dtype: str, num_blocks: int, compile_model: bool) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "sluice_vllm.launcher", "serve", model_dir, "--load-format", "dummy",
               "--skip-tokenizer-init", "--dtype", dtype, "--block-size", str(BLOCK),
               "--num-gpu-blocks-override", str(num_blocks + 1), "--gpu-memory-utilization", "0.2",
               "--no-enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        cmd += [] if compile_model else ["--enforce-eager"]
        # NOTE: its engine's thread on the last core, where `sluice serve` places its worker (a
        # bind to core 0 put it beside its API server and this client)
        last = str(sorted(os.sched_getaffinity(0))[-1])
        env = {**LAUNCH_ENV, "VLLM_CPU_OMP_THREADS_BIND": last, "OMP_NUM_THREADS": "1"}
        self.log = open(os.devnull, "w")  # noqa: SIM115  (open for the process's lifetime)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.model = model_dir
        deadline = time.monotonic() + 600
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) before answering")
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not answer within 600 s")
            time.sleep(1.0)

    def _ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(self.base_url + "/models", timeout=5).read()
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def run(self, jobs: Sequence[Job], online: bool) -> dict[str, float]:
        stats = summarize(asyncio.run(http_traces(self.base_url, self.model, jobs, online, "vllm-serve")))
        return stats if online else {"output_tok_s": stats["output_tok_s"]}


# ---------------------------------------------------------------- every policy on (b)


def run_policies(args: argparse.Namespace, offline_jobs: list[Job], online_jobs: list[Job]) -> list[dict]:
    """`sluice serve --engine vllm` once per policy (one at a time): the offline and the online
    jobs, each policy's greedy tokens compared request by request with the first policy's."""
    rows, reference = [], None
    for policy in args.policies.split(","):
        serve = SluiceServe("vllm", args.model, args.dtype, args.num_blocks, not args.no_compile, policy=policy)
        try:
            asyncio.run(serve.traces(make_jobs(4, 1000, None, seed=9), online=False))  # warm-up
            offline = asyncio.run(serve.traces(offline_jobs, online=False))
            online = asyncio.run(serve.traces(online_jobs, online=True))
        finally:
            serve.stop()
        ids = [t.ids for t in offline]
        reference = reference or ids
        stats = summarize(online)
        row = {
            "policy": policy,
            "finished": sum(
                len(t.ids) == j.max_tokens for t, j in zip(offline + online, offline_jobs + online_jobs, strict=True)
            ),
            "requests": len(offline_jobs) + len(online_jobs),
            "offline_tok_s": summarize(offline)["output_tok_s"],
            "tokens_equal_to_first": sum(a == b for a, b in zip(ids, reference, strict=True)),
            **{f"online_{k}": v for k, v in stats.items()},
        }
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    first = rows[0]["policy"]
    table = [
        {
            "policy": r["policy"],
            "finished": f"{r['finished']}/{r['requests']}",
            "offline tok/s": r["offline_tok_s"],
            "TBT p50 ms": r["online_tbt_p50_ms"],
            "TTFT p50 ms": r["online_ttft_p50_ms"],
            "E2E mean s": r["online_e2e_mean_s"],
            f"tokens equal to {first}'s": f"{r['tokens_equal_to_first']}/{len(ids)}",
        }
        for r in rows
    ]
    one = "{:.1f}"
    formats = {"offline tok/s": one, "TBT p50 ms": one, "TTFT p50 ms": one, "E2E mean s": "{:.2f}"}
    print("\n" + format_table(table, formats=formats))
    return rows


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--model", default="tiny-llama", help="a preset of ours (dummy weights) or a local HF directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (online)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks of 32 tokens for every engine")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--online-rounds", type=int, default=1)
    p.add_argument(
        "--engines",
        default="vllm,sluice+vllm,sluice+torch",
        help="of vllm, sluice+vllm, sluice+torch (variants of the last two: see above), and over OpenAI "
        "HTTP (online only) vllm-serve, sluice+vllm-http",
    )
    p.add_argument("--no-compile", action="store_true", help="vLLM eager in (a) and (b) (its default compiles)")
    p.add_argument("--json", help="write the per-round results here")
    p.add_argument(
        "--pin",
        action="store_true",
        help="each model runner on a core of its own: (b)'s worker (--worker-cpus) and (a) on the last core, "
        "(b)'s scheduler (--scheduler-cpus) and this client on the others",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another revision: its (b) runs beside this tree's as sluice+vllm@baseline",
    )
    p.add_argument(
        "--policies",
        help="instead of the comparison: (b) once per policy (comma-separated, the first is the token reference)",
    )
    args = p.parse_args(argv)

    from worker_service.model import resolve_config
    from worker_service.vllm_engine import model_directory

    vocab = resolve_config(args.model).vocab_size
    offline_jobs = make_jobs(args.num_requests, vocab, None, seed=0)
    online_jobs = make_jobs(args.num_requests, vocab, args.rate, seed=1)
    if args.policies:
        rows = run_policies(args, offline_jobs, online_jobs)
        if args.json:
            write_json({"args": vars(args), "policies": rows}, args.json, indent=2, quiet=True)
        return 0
    names = args.engines.split(",")
    if args.baseline is not None and "sluice+vllm" in names:
        names.insert(names.index("sluice+vllm") + 1, "sluice+vllm" + BASELINE)
    compile_model = not args.no_compile
    cores = sorted(os.sched_getaffinity(0))
    runner_core, rest = {cores[-1]}, set(cores[:-1]) or set(cores)
    pin_flags = ["--worker-cpus", str(cores[-1]), "--scheduler-cpus", ",".join(map(str, sorted(rest)))]
    print(f"starting {names} for {args.model} {args.dtype}", flush=True)
    runners: dict[str, object] = {}
    placed: dict[str, list[int]] = {}
    try:
        for name in names:
            if name == "vllm":
                runners[name] = VllmAlone(model_directory(args.model), args.dtype, args.num_blocks, compile_model)
            elif name == "vllm-serve":
                runners[name] = VllmServe(model_directory(args.model), args.dtype, args.num_blocks, compile_model)
            else:
                engine, *suffixes = name.split("+")[1].split("@")
                variants = {f"@{v}" for v in suffixes}
                if variants - set(VARIANTS):
                    raise SystemExit(f"error: {name}: variants are {', '.join(VARIANTS)}")
                runners[name] = SluiceServe(
                    engine.removesuffix("-http"),
                    args.model,
                    args.dtype,
                    args.num_blocks,
                    compile_model,
                    http=engine.endswith("-http"),
                    root=args.baseline.resolve() if BASELINE in variants else ROOT,
                    extra=[*(pin_flags if args.pin else ()), *variant_flags(variants, cores)],
                    one_thread=SERVE_THREADS not in variants,
                )
                placed[name] = runners[name].worker_cpus()  # type: ignore[attr-defined]
                print(f"{name}: worker on CPUs {placed[name]}", flush=True)
        warm = make_jobs(4, vocab, None, seed=9)
        for name, runner in runners.items():  # first steps (compilation, allocator) are not measured
            runner.offline(warm) if name == "vllm" else runner.run(warm, online=False)  # type: ignore[attr-defined]
        results: list[dict[str, object]] = []
        for r in range(max(args.rounds, args.online_rounds)):
            for mode, jobs, wanted in (
                ("offline", offline_jobs, args.rounds),
                ("online", online_jobs, args.online_rounds),
            ):
                if r >= wanted:
                    continue
                row: dict[str, object] = {"round": r, "mode": mode, "load_average": list(os.getloadavg())}
                for name in names if r % 2 == 0 else list(reversed(names)):
                    if mode == "offline" and name in HTTP_ENGINES:
                        continue  # NOTE: offline throughput is (a) LLM.generate's; HTTP runs are online
                    runner = runners[name]
                    if args.pin:  # NOTE: this thread only: (a)'s model runs on it, (b)'s client loop too
                        os.sched_setaffinity(0, runner_core if name == "vllm" else rest)
                    elif REMOTE_CLIENT in name:
                        os.sched_setaffinity(0, (set(cores) - set(placed[name])) or set(cores))
                    if name == "vllm":
                        stats = runner.offline(jobs) if mode == "offline" else runner.online(jobs)  # type: ignore[attr-defined]
                    else:
                        stats = runner.run(jobs, online=mode == "online")  # type: ignore[attr-defined]
                    row[name] = stats
                    os.sched_setaffinity(0, cores)
                    print(
                        f"round {r} {mode} {name}: {json.dumps({k: round(v, 3) for k, v in stats.items()})}", flush=True
                    )
                results.append(row)
    finally:
        for runner in runners.values():
            if isinstance(runner, SluiceServe | VllmServe):
                runner.stop()
    report(results, names)
    if args.json:
        write_json({"args": vars(args), "worker_cpus": placed, "rounds": results}, args.json, indent=2, quiet=True)
    return 0


def variant_flags(variants: set[str], cores: Sequence[int]) -> list[str]:
    """The `sluice serve` flags of a variant's suffixes (@baseline and @serve-threads have none)."""
    flags = ["--no-auto-pin"] if NO_AUTO_PIN in variants else []
    # NOTE: a CPU list turns the automatic placement off: the scheduler and the rest float
    return flags + (["--worker-cpus", str(cores[-1])] if WORKER_ONLY in variants else [])


def report(results: list[dict[str, object]], names: Sequence[str]) -> None:
    """Each engine as a ratio to its reference within the round: (a) in-process for the gRPC
    and in-process runs, `vllm serve` for the runs over OpenAI HTTP."""
    for mode, key, better in (("offline", "output_tok_s", "higher"), ("online", "tbt_p50_ms", "lower")):
        rows = [r for r in results if r["mode"] == mode]
        for name in names:
            reference = "vllm-serve" if name in HTTP_ENGINES else "vllm"
            if name == reference or reference not in names or not rows or name not in rows[0]:
                continue
            ratios = [r[name][key] / r[reference][key] for r in rows]  # type: ignore[index]
            print(_rounds_line(f"{mode} {key} {name}/{reference}", ratios, better))
            if mode == "offline" and "cpu_ms_per_token" in rows[0][reference]:  # type: ignore[operator]
                # NOTE: (a)'s whole process against (b)'s worker process alone: the CPU the one
                # core running the model spends per token, which load on other cores leaves alone.
                cpu = [r[reference]["cpu_ms_per_token"] / r[name]["cpu_ms_per_token"] for r in rows]  # type: ignore[index]
                print(_rounds_line(f"offline CPU per token {reference} process / {name} worker", cpu, "higher"))
                # NOTE: CPU per token times tokens/s: the share of the wall time the process ran (all
                # its threads); tokens/s is CPU per token over this share, so the two split a gap.
                for who in (reference, name):
                    share = [r[who]["cpu_ms_per_token"] * r[who]["output_tok_s"] / 1e3 for r in rows]  # type: ignore[index]
                    print(_rounds_line(f"offline running share of {who}", share))
        for base in [n for n in names if n.endswith(VARIANTS)]:
            if not rows or base not in rows[0]:
                continue
            # NOTE: against the engine without the last suffix: a@x@y against a@x
            name = base.rpartition("@")[0]
            if name not in rows[0]:
                continue
            ratios = [r[name][key] / r[base][key] for r in rows]  # type: ignore[index]
            print(_rounds_line(f"{mode} {key} {name}/{base}", ratios, better))
            if mode == "offline" and "cpu_ms_per_token" in rows[0][base]:  # type: ignore[operator]
                cpu = [r[base]["cpu_ms_per_token"] / r[name]["cpu_ms_per_token"] for r in rows]  # type: ignore[index]
                print(_rounds_line(f"offline CPU per token {base} worker / {name} worker", cpu, "higher"))


def _rounds_line(label: str, values: list[float], better: str = "") -> str:
    """`label: median M (rounds a, b, c; higher is better)`, the report's one line shape."""
    rounds = ", ".join(f"{x:.3f}" for x in values)
    verdict = f"; {better} is better" if better else ""
    return f"{label}: median {statistics.median(values):.3f} (rounds {rounds}{verdict})"


if __name__ == "__main__":
    sys.exit(main())
