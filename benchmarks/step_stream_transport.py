"""What the step stream's transport costs a worker per step: gRPC (as `sluice worker` serves its
Execute stream) against a plain Unix-domain socket carrying the same messages.

    client (the scheduler's side): keeps two plans on the stream (overlapped scheduling), reads
        each answer and sends the next plan, `--steps` times
    server (the worker's side, a process of its own, on its own core where there are two):
        reads a plan (ExecuteRequest bytes), decodes it, busy-waits `--step-ms` (the step's
        forward, on the CPU as a CPU engine's is), encodes the answer (ExecuteResponse) and
        writes it
    grpc: grpc.aio bidirectional stream, messages serialized by gRPC
    unix: asyncio stream over a Unix socket, each message a 4-byte length and its bytes

Printed per transport (median of `--rounds`, the transports alternated): the server process's
CPU per step beyond the busy-wait (every thread: the loop's own and gRPC's), and the step period
beyond it as the client sees it. The difference between the two transports is what a
transport of our own could take off each step of a worker whose step is `--step-ms` long.

    python benchmarks/step_stream_transport.py [--steps 3000] [--step-ms 2] [--num-seqs 1] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc

from sluice.contract.plan import CachedRequestData, StepPlan, StepResult
from sluice.contract.plan_codec import PlanReceiver, PlanSender, result_to_proto, step_order
from sluice.v1 import worker_pb2
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table

METHOD = "/bench.StepStream/Execute"
HEADER = struct.Struct("<I")


def decode_plan(step_id: int, num_seqs: int) -> StepPlan:
    """A steady decode step: every request known to the worker, none of their tables grown."""
    ids = tuple(f"req-{i:05d}" for i in range(num_seqs))
    return StepPlan(step_id, 0, (), CachedRequestData(), dict.fromkeys(ids, 1), frozenset(ids), token_budget=512)


def _answer(receiver: PlanReceiver, raw: bytes, step_s: float) -> bytes:
    """The worker's side of one step: decode, the step's busy-wait, the answer encoded."""
    plan = receiver.decode(worker_pb2.ExecuteRequest.FromString(raw))
    end = time.perf_counter() + step_s
    while time.perf_counter() < end:
        pass
    result = StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 7), step_s)
    return result_to_proto(result, step_order(plan)).SerializeToString()


async def _serve_grpc(address: str, step_s: float) -> None:
    async def execute(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        receiver = PlanReceiver(0)
        async for raw in requests:
            yield _answer(receiver, raw, step_s)

    handler = grpc.method_handlers_generic_handler(
        "bench.StepStream", {"Execute": grpc.stream_stream_rpc_method_handler(execute)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


async def _serve_unix(path: str, step_s: float) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        receiver = PlanReceiver(0)
        try:
            while True:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                answer = _answer(receiver, await reader.readexactly(size), step_s)
                writer.write(HEADER.pack(len(answer)) + answer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_unix_server(connection, path)
    await server.serve_forever()


def _server_main(kind: str, address: str, step_s: float, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    asyncio.run(_serve_grpc(address, step_s) if kind == "grpc" else _serve_unix(address, step_s))


Writer = Callable[[bytes], Awaitable[None]]
Reader = Callable[[], Awaitable[bytes]]


async def _connect(kind: str, address: str) -> tuple[Writer, Reader, Callable[[], Awaitable[None]]]:
    if kind == "grpc":
        channel = grpc.aio.insecure_channel(address)
        call = channel.stream_stream(METHOD)(wait_for_ready=True)

        async def read_grpc() -> bytes:
            return await call.read()

        return call.write, read_grpc, channel.close
    reader, writer = await asyncio.open_unix_connection(address)

    async def write(raw: bytes) -> None:
        writer.write(HEADER.pack(len(raw)) + raw)
        await writer.drain()

    async def read() -> bytes:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        return await reader.readexactly(size)

    async def close() -> None:
        writer.close()

    return write, read, close


async def _drive(kind: str, address: str, steps: int, num_seqs: int) -> float:
    """Seconds per step, steady state: two plans in flight, as overlapped scheduling keeps them."""
    sender = PlanSender()
    plans = (sender.encode(decode_plan(k + 1, num_seqs)).SerializeToString() for k in range(steps + 22))
    write, read, close = await _connect(kind, address)
    for _ in range(2):
        await write(next(plans))
    for _ in range(20):  # warm-up
        await read()
        await write(next(plans))
    start = time.perf_counter()
    for _ in range(steps):
        await read()
        await write(next(plans))
    period = (time.perf_counter() - start) / steps
    await read()
    await read()
    await close()
    return period


def _listening(path: str) -> bool:
    """The server's socket accepts connections (it exists once bound, before it listens)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
    return True


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, steps: int, step_s: float, num_seqs: int, folder: str) -> tuple[float, float]:
    """(server CPU per step beyond the busy-wait, step period beyond it), in seconds."""
    cores = sorted(os.sched_getaffinity(0))
    server_cpu = cores[-1] if len(cores) > 1 else None
    address = f"unix:{folder}/grpc.sock" if kind == "grpc" else f"{folder}/plain.sock"
    Path(address.removeprefix("unix:")).unlink(missing_ok=True)  # a previous round's server left it
    server = mp.get_context("spawn").Process(target=_server_main, args=(kind, address, step_s, server_cpu))
    server.start()
    try:
        deadline = time.monotonic() + 30
        while not _listening(address.removeprefix("unix:")):
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError(f"the {kind} server did not start")
            time.sleep(0.05)
        before = _process_cpu_s(server.pid)
        period = asyncio.run(_drive(kind, address, steps, num_seqs))
        cpu = (_process_cpu_s(server.pid) - before) / (steps + 22)
    finally:
        server.terminate()
        server.join()
    return cpu - step_s, period - step_s


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--step-ms", type=float, default=2.0, help="the step's busy-wait (tiny-llama's step is about 2 ms)")
    p.add_argument("--num-seqs", type=int, default=1, help="decoding requests in the step")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    kinds = ("grpc", "unix")
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    period: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else reversed(kinds):
                c, t = measure(kind, args.steps, args.step_ms / 1e3, args.num_seqs, folder)
                cpu[kind].append(c)
                period[kind].append(t)
    rows = [
        {
            "transport": kind,
            "server CPU / step beyond the step, ms": statistics.median(cpu[kind]) * 1e3,
            "rounds": ", ".join(f"{x * 1e3:.3f}" for x in cpu[kind]),
            "period beyond the step, ms": statistics.median(period[kind]) * 1e3,
        }
        for kind in kinds
    ]
    print(f"{args.num_seqs} decoding request(s), {args.step_ms:g} ms step, {args.steps} steps, {args.rounds} rounds")
    ms = "{:.3f}"
    print_table(rows, formats={"server CPU / step beyond the step, ms": ms, "period beyond the step, ms": ms})


if __name__ == "__main__":
    main()
