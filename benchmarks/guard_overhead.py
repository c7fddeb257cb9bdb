"""What the server guard costs a step: the worker's Execute round trip with GrpcServer.build's
GuardInterceptor (API keys, tolerant parsing: one async-generator relay per streamed message,
each way) against the same servicer on a bare grpc.aio server, side by side in one run.

    echo worker (no model) in this process, client on the same event loop
    n sequences: one prefill step, then decode steps (same ids: `same_scheduled_ids`)
    rounds interleave the two servers; the figure is the median over rounds of the median step

    python benchmarks/guard_overhead.py [--sizes 1,64,256] [--steps 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc
from grpc_health.v1 import health

from sluice.common.grpc_server import KEEPALIVE, GrpcServer
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.plan_codec import PlanSender
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2, worker_pb2_grpc
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import EngineRunner, WarmupDefaults, WorkerServicer, build_server

BLOCKS_PER_REQUEST = 16  # 256 tokens: room for the prefill and every decode step
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


async def bare_server() -> tuple[grpc.aio.Server, int]:
    engine = EchoEngine(EngineConfig(model="tiny-llama"))
    servicer = WorkerServicer(EngineRunner(engine), health.aio.HealthServicer(), 0, WarmupDefaults())
    server = grpc.aio.server(options=KEEPALIVE.server_options())
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def plans(n: int, steps: int) -> list[StepPlan]:
    ids = [f"r{i}" for i in range(n)]
    new = tuple(
        NewRequestData(
            rid, tuple(range(1000, 1008)), 8, GREEDY, tuple(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))
        )
        for i, rid in enumerate(ids)
    )
    out = [StepPlan(1, 0, new, CachedRequestData(), dict.fromkeys(ids, 8), frozenset(ids))]
    for s in range(2, steps + 2):
        out.append(StepPlan(s, 0, (), CachedRequestData(), dict.fromkeys(ids, 1), frozenset(ids)))
    return out


async def step_times(port: int, n: int, steps: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=KEEPALIVE.channel_options()) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        warm = await stub.Warmup(
            worker_pb2.WarmupRequest(num_gpu_blocks_override=n * BLOCKS_PER_REQUEST, swap_space_gib=1e-3),
            metadata=_session(""),
        )
        call = stub.Execute(metadata=_session(warm.session_id))
        sender = PlanSender()
        times = []
        for plan in plans(n, steps):
            start = time.perf_counter()
            await call.write(sender.encode(plan))
            result = sender.decode(await call.read(), plan)
            times.append(time.perf_counter() - start)
            assert result.error is None, result.error
        await call.done_writing()
        await call.read()
        await stub.Release(worker_pb2.ReleaseRequest(end_lease=True), metadata=_session(warm.session_id))
    return times[1:]  # the prefill step is not a steady step


def _session(session: str) -> tuple[tuple[str, str], ...]:
    return (("x-sluice-session", session),) if session else ()


async def main(args: argparse.Namespace) -> None:
    guarded: GrpcServer = build_server(EchoEngine(EngineConfig(model="tiny-llama")), 0)
    await guarded.start(ready=False)
    bare, bare_port = await bare_server()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for n in sizes:
            for name, port in (("guarded", guarded.port), ("bare", bare_port)):
                results.setdefault((name, n), []).append(statistics.median(await step_times(port, n, args.steps)))
    await guarded.server.stop(None)
    await bare.stop(None)
    where = f"echo worker, in-process; median of {args.rounds} rounds x {args.steps} steps"
    print(f"Execute round trip per decode step ({where})")
    rows = []
    for n in sizes:
        bare_us = 1e6 * statistics.median(results[("bare", n)])
        guard_us = 1e6 * statistics.median(results[("guarded", n)])
        rows.append({"sequences": n, "bare us": bare_us, "guarded us": guard_us, "difference us": guard_us - bare_us})
    print_table(rows, formats={"bare us": "{:.0f}", "guarded us": "{:.0f}", "difference us": "{:+.0f}"})


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
