"""`sluice serve` (workers as subprocesses + the scheduler in this process) and
`sluice scheduler` (the scheduler alone, against running workers).

    sluice serve [--config FILE] [--workers K] [--policy P] [--model M] [--port N] [--demo]
        spawn K `sluice worker --port 0` processes -> read "listening on HOST:PORT" from each
        -> wait for their liveness health -> LiveScheduler + SchedulerServer (Warmup, loops)
        -> print where it listens -> serve until SIGINT/SIGTERM (or, with --demo, replay a
        trace slice against itself with a progress bar and print the metrics table)
        -> graceful shutdown: health NOT_SERVING, in-flight streams get a grace period,
           then the workers get SIGTERM (SIGKILL if they linger)
    sluice scheduler --worker HOST:PORT [--worker ...] [--policy P] [--port N]

Settings come from the dataclass defaults, then the --config file (JSON, or TOML by its
.toml suffix; keys are the field names), then the flags given on the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LISTENING = re.compile(rb"listening on ([\w.\-\[\]:]+):(\d+)")


@dataclass
class ServeConfig:
    workers: int = 2
    policy: str = "vllm"
    router: str = "round_robin"
    model: str = "tiny-llama"
    load_format: str = "auto"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    worker_addresses: list[str] = field(default_factory=list)  # `sluice scheduler`: workers already running
    num_gpu_blocks: int | None = 512  # per worker; a fixed pool on CPU instead of measuring free RAM
    swap_space_gib: float = 0.05
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    default_max_tokens: int = 256
    worker_threads: int = 0  # torch threads per worker; 0: the cores shared out evenly
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    worker_start_timeout_s: float = 120.0
    grace_s: float = 5.0

    def live_config(self) -> Any:
        from scheduler_service.live.config import LiveConfig

        return LiveConfig(
            policy=self.policy,
            router=self.router,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_waiting=self.max_waiting,
            default_max_tokens=self.default_max_tokens,
            num_gpu_blocks=self.num_gpu_blocks,
            swap_space_gib=self.swap_space_gib,
        )


def load_config(path: str | None, overrides: dict[str, Any]) -> ServeConfig:
    """Defaults < the config file < flags given (None values in `overrides` are not given)."""
    values: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        raw = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
        values.update({k.replace("-", "_"): v for k, v in raw.items()})
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(ServeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown serve settings {unknown}; known: {', '.join(sorted(known))}")
    return ServeConfig(**values)


# ---------------------------------------------------------------- worker processes


@dataclass
class WorkerProcess:
    worker_id: int
    proc: asyncio.subprocess.Process
    address: str = ""
    _drain: asyncio.Task | None = None


def worker_command(cfg: ServeConfig, worker_id: int) -> list[str]:
    threads = cfg.worker_threads or max(1, (os.cpu_count() or 1) // max(1, cfg.workers))
    cmd = [sys.executable, "-m", "services.cli", "worker", "--host", cfg.host, "--port", "0"]
    cmd += ["--worker-id", str(worker_id), "--model", cfg.model, "--load-format", cfg.load_format]
    cmd += ["--device", cfg.device, "--swap-space-gib", str(cfg.swap_space_gib), "--threads", str(threads)]
    if cfg.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks", str(cfg.num_gpu_blocks)]
    return cmd


async def _listening_address(worker: WorkerProcess, timeout_s: float) -> str:
    stdout = worker.proc.stdout
    assert stdout is not None
    async with asyncio.timeout(timeout_s):
        while line := await stdout.readline():
            if match := _LISTENING.search(line):
                return f"{match.group(1).decode()}:{match.group(2).decode()}"
    raise RuntimeError(f"worker {worker.worker_id} exited (code {worker.proc.returncode}) before listening")


async def _drain_output(worker: WorkerProcess) -> None:
    """Keeps the worker's pipe from filling up; its lines go to our debug log."""
    assert worker.proc.stdout is not None
    while line := await worker.proc.stdout.readline():
        log.debug("worker %d: %s", worker.worker_id, line.decode(errors="replace").rstrip())


async def wait_for_liveness(address: str, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"worker at {address} is not alive: {reply.status}")


async def start_workers(cfg: ServeConfig) -> list[WorkerProcess]:
    workers = []
    try:
        for w in range(cfg.workers):
            proc = await asyncio.create_subprocess_exec(
                *worker_command(cfg, w), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
            )
            workers.append(WorkerProcess(w, proc))
        for worker in workers:
            worker.address = await _listening_address(worker, cfg.worker_start_timeout_s)
            worker._drain = asyncio.create_task(_drain_output(worker))
        await asyncio.gather(*(wait_for_liveness(w.address, cfg.worker_start_timeout_s) for w in workers))
    except BaseException:
        await stop_workers(workers)
        raise
    return workers


async def stop_workers(workers: Sequence[WorkerProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM (the worker shuts down gracefully), SIGKILL for any that lingers."""
    for worker in workers:
        if worker.proc.returncode is None:
            worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            await asyncio.wait_for(worker.proc.wait(), timeout_s)
        except TimeoutError:
            worker.proc.kill()
            await worker.proc.wait()
        if worker._drain is not None:
            worker._drain.cancel()


# ---------------------------------------------------------------- the scheduler


async def start_scheduler(cfg: ServeConfig, addresses: Sequence[str]) -> Any:
    from scheduler_service.live.service import LiveScheduler
    from scheduler_service.server import SchedulerServer
    from sluice.common.telemetry import setup_tracing

    setup_tracing("sluice-scheduler")
    serving = None
    if cfg.metrics_port is not None:
        from sluice.common.prom import ServingMetrics, start_metrics_server

        serving = ServingMetrics(cfg.model)
        port = start_metrics_server(cfg.metrics_port, serving, cfg.host)
        print(f"sluice metrics on http://{cfg.host}:{port}/metrics", flush=True)
    live = LiveScheduler(addresses, cfg.live_config(), serving)
    return await SchedulerServer.start(live, cfg.port, host=cfg.host)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _until(stop: asyncio.Event, work: Any) -> None:
    """Runs `work` (a coroutine) until it ends or `stop` is set, whichever comes first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def serve(cfg: ServeConfig, demo: DemoOptions | None = None) -> int:
    stop = _stop_event()
    print(f"starting {cfg.workers} {cfg.model} workers on {cfg.device} ...", flush=True)
    workers = await start_workers(cfg)
    try:
        server = await start_scheduler(cfg, [w.address for w in workers])
        try:
            where = ", ".join(w.address for w in workers)
            print(
                f"sluice scheduler listening on {cfg.host}:{server.port} "
                f"(policy {cfg.policy}, router {cfg.router}, model {cfg.model}; workers {where})",
                flush=True,
            )
            await _until(stop, run_demo(server, cfg, demo) if demo else stop.wait())
        finally:
            print("sluice shutting down", flush=True)
            await server.stop(cfg.grace_s)
    finally:
        await stop_workers(workers)
    return 0


async def serve_scheduler(cfg: ServeConfig) -> int:
    stop = _stop_event()
    server = await start_scheduler(cfg, cfg.worker_addresses)
    print(
        f"sluice scheduler listening on {cfg.host}:{server.port} (policy {cfg.policy}, router {cfg.router}, "
        f"model {server.live.model}; workers {', '.join(cfg.worker_addresses)})",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        print("sluice scheduler shutting down", flush=True)
        await server.stop(cfg.grace_s)
    return 0


# ---------------------------------------------------------------- the demo


@dataclass
class DemoOptions:
    trace: str = "azure-conv"
    num_requests: int = 40
    duration_s: float = 8.0  # the slice's arrivals are compressed into this many seconds
    prompt_scale: float = 1 / 8  # trace lengths shrunk to fit the tiny model
    output_scale: float = 1 / 4
    max_prompt: int = 256
    max_output: int = 64
    ttft_ms: float = 2000.0
    tbt_ms: float = 250.0


@dataclass(frozen=True)
class DemoRequest:
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int


def demo_requests(opts: DemoOptions, model: str) -> list[DemoRequest]:
    """A slice of a real trace, lengths scaled and clipped; prompts are windows of real
    ShareGPT text tokenized with the model's tokenizer, cut to the trace's lengths."""
    from scheduler_service.sim.workloads import load_trace
    from worker_service.tokenizer import Tokenizer

    trace = load_trace(opts.trace, num_requests=opts.num_requests).requests
    corpus = Tokenizer.for_model(model).encode(" ".join(_demo_texts(20)))
    span = max((r.arrival_s or 0.0) for r in trace) or 1.0
    out = []
    for i, r in enumerate(trace):
        n_prompt = int(min(opts.max_prompt, max(8, round(r.prompt_tokens * opts.prompt_scale))))
        n_out = int(min(opts.max_output, max(4, round(r.output_tokens * opts.output_scale))))
        start = (i * 97) % max(1, len(corpus) - n_prompt)
        arrival = (r.arrival_s or 0.0) * opts.duration_s / span
        out.append(DemoRequest(arrival, corpus[start : start + n_prompt], n_out))
    return out


def _demo_texts(n: int) -> list[str]:
    import gzip

    from sluice.common.paths import data_dir

    texts = []
    with gzip.open(data_dir() / "prompts" / "sharegpt_v3_conversations.jsonl.gz", "rt") as f:
        for line in f:
            turns = json.loads(line).get("conversations", [])
            texts += [t["value"] for t in turns[:2]]
            if len(texts) >= n:
                break
    return texts


async def run_demo(server: Any, cfg: ServeConfig, opts: DemoOptions) -> None:
    import grpc
    from tqdm import tqdm

    from scheduler_service.sim.report import format_table
    from scheduler_service.sim.simulator import SimRun
    from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    requests = demo_requests(opts, cfg.model)
    slo = common_pb2.SloSpec(ttft_ms=opts.ttft_ms, tbt_ms=opts.tbt_ms)
    bar = tqdm(total=len(requests), desc=f"demo {opts.trace} x{len(requests)}", unit="req")
    tokens = 0

    async def one(stub: Any, i: int, r: DemoRequest, start: float) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, start + r.arrival_s - loop.time()))
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        msg = generation_pb2.GenerateRequest(
            request_id=f"demo-{i}", token_ids=common_pb2.TokenIds(ids=r.prompt_ids), sampling_params=sampling, slo=slo
        )
        async for m in stub.Generate(msg):
            tokens += len(m.token_ids)
            bar.set_postfix(tokens=tokens, refresh=False)
        bar.update(1)

    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        start = loop.time()
        await asyncio.gather(*(one(stub, i, r, start) for i, r in enumerate(requests)))
    bar.close()
    metrics = server.live.metrics
    run = SimRun(
        cfg.policy, f"{opts.trace}[:{len(requests)}] scaled", asdict(cfg), metrics.summary(), metrics.details()
    )
    print(
        f"live: {len(requests)} requests of {opts.trace} (prompts x{opts.prompt_scale:g} <= {opts.max_prompt}, "
        f"outputs x{opts.output_scale:g} <= {opts.max_output}) over {opts.duration_s:g} s, "
        f"SLO TTFT {opts.ttft_ms:g} ms / TBT {opts.tbt_ms:g} ms, {cfg.workers} x {cfg.model} on {cfg.device}"
    )
    print(format_table([run]))


# ---------------------------------------------------------------- command lines


def add_serve_arguments(p: argparse.ArgumentParser, *, workers: bool) -> None:
    """Flags default to None so that only those given override the config file."""
    p.add_argument("--config", help="settings file: JSON, or TOML (.toml); keys are ServeConfig's fields")
    p.add_argument("--port", type=int, help="scheduler port (default 50051; 0 picks a free one)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--policy", help="policy[:key=value,...] (default vllm)")
    p.add_argument("--router", help="router[:key=value,...] (default round_robin)")
    p.add_argument("--max-waiting", type=int, help="queue bound, all workers (default 256)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks per worker (default 512)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    if workers:
        p.add_argument("--workers", type=int, help="worker processes (default 2)")
        p.add_argument("--model", help="model preset or checkpoint folder (default tiny-llama)")
        p.add_argument("--device", help="cpu or cuda (default cpu)")
        p.add_argument("--demo", action="store_true", help="replay a slice of azure-conv against itself, then exit")
        p.add_argument("--demo-requests", type=int, default=40)
    else:
        p.add_argument("--worker", action="append", required=True, help="HOST:PORT of a running worker; repeat")


_FLAGS = (
    "port",
    "host",
    "policy",
    "router",
    "max_waiting",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_gpu_blocks",
    "metrics_port",
    "workers",
    "model",
    "device",
)


def _config_from(args: argparse.Namespace) -> ServeConfig:
    overrides = {name: getattr(args, name, None) for name in _FLAGS}
    if getattr(args, "worker", None):
        from scheduler_service.server import worker_addresses

        overrides["worker_addresses"] = worker_addresses(args.worker)
    return load_config(args.config, overrides)


def _logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    _logging()
    cfg = _config_from(args)
    demo = DemoOptions(num_requests=args.demo_requests) if args.demo else None
    return asyncio.run(serve(cfg, demo))


def cmd_scheduler(args: argparse.Namespace) -> int:
    _logging()
    return asyncio.run(serve_scheduler(_config_from(args)))
