"""Live KV transfer between two CPU worker processes against loopback gRPC bandwidth, side by side.

    python benchmarks/kv_transfer.py --model opt-125m --tokens 4096 --repeats 10

Two `sluice worker` processes (torch engine, dummy weights) warm up with room for the KV; each
repeat is what the scheduler does for one disaggregated request: OfferKv on the prefill worker
(a one-time token), then PullKv on the decode worker, which reads the blocks from the prefill
worker over a ReadKv stream and writes them into its own cache. Beside it, in the same run and
alternating with it, the loopback baseline: a third process streams the same number of bytes in
chunks of the same size over the same kind of gRPC channel to this process, which drops them
(no gather, no copy into a cache): the wire as fast as gRPC carries it on this machine. The
ratio of the two medians is the target (>= 50%).

The KV's content does not change the bytes moved (blocks are sent raw, or int8 of a fixed size),
so the blocks are transferred as the warm-up left them, without a 4k-token prefill first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from tqdm import tqdm

from sluice.common.grpc_server import KEEPALIVE
from sluice.v1 import worker_pb2, worker_pb2_grpc
from sluice_bench.live import spawn_worker
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

LOOPBACK_METHOD = "/sluice.bench.Loopback/Read"


# -- the loopback baseline -------------------------------------------------------------------


async def serve_loopback() -> None:
    """A server streaming `total` bytes in chunks of `chunk` (request: b"total,chunk")."""

    async def read(request: bytes, context: grpc.aio.ServicerContext):
        total, chunk = (int(x) for x in request.decode().split(","))
        payload = bytes(chunk)
        sent = 0
        while sent < total:
            part = payload if total - sent >= chunk else payload[: total - sent]
            yield part
            sent += len(part)

    handler = grpc.method_handlers_generic_handler(
        "sluice.bench.Loopback", {"Read": grpc.unary_stream_rpc_method_handler(read)}
    )
    server = grpc.aio.server(options=KEEPALIVE.server_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"loopback listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def loopback_once(channel: grpc.aio.Channel, total: int, chunk: int) -> float:
    call = channel.unary_stream(LOOPBACK_METHOD)(f"{total},{chunk}".encode())
    start = time.perf_counter()
    got = 0
    async for part in call:
        got += len(part)
    elapsed = time.perf_counter() - start
    assert got == total, (got, total)
    return elapsed


# -- the KV transfer -------------------------------------------------------------------------


async def warm(stub: worker_pb2_grpc.WorkerServiceStub, blocks: int, role: int) -> tuple[str, int]:
    warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=blocks, swap_space_gib=0.001, role=role))
    return warm.session_id, warm.bytes_per_block


async def transfer_once(
    prefill: worker_pb2_grpc.WorkerServiceStub,
    decode: worker_pb2_grpc.WorkerServiceStub,
    sessions: tuple[str, str],
    prefill_address: str,
    num_blocks: int,
    per_chunk: int,
    int8: bool,
) -> tuple[float, float, int]:
    """(wall seconds offer + pull, the decode worker's transfer seconds, bytes)."""
    start = time.perf_counter()
    offer = await prefill.OfferKv(
        worker_pb2.OfferKvRequest(request_id="bench", block_ids=range(num_blocks), int8=int8),
        metadata=(("x-sluice-session", sessions[0]),),
    )
    pulled = await decode.PullKv(
        worker_pb2.PullKvRequest(
            peer_address=prefill_address, token=offer.token, block_ids=range(num_blocks), blocks_per_chunk=per_chunk
        ),
        metadata=(("x-sluice-session", sessions[1]),),
    )
    return time.perf_counter() - start, pulled.transfer_s, pulled.nbytes


async def run(args: argparse.Namespace) -> dict:
    workers = [spawn_worker(engine="torch", model=args.model, worker_id=i, threads=args.threads) for i in range(2)]
    loop_proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-loopback"], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
    )
    try:
        assert loop_proc.stdout is not None
        loop_address = loop_proc.stdout.readline().split()[-1]
        options = KEEPALIVE.channel_options()
        async with (
            grpc.aio.insecure_channel(workers[0].address, options=options) as c0,
            grpc.aio.insecure_channel(workers[1].address, options=options) as c1,
            grpc.aio.insecure_channel(loop_address, options=options) as cl,
        ):
            prefill, decode = worker_pb2_grpc.WorkerServiceStub(c0), worker_pb2_grpc.WorkerServiceStub(c1)
            info = await prefill.Info(worker_pb2.InfoRequest())
            num_blocks = -(-args.tokens // info.block_size)
            s0, bytes_per_block = await warm(prefill, num_blocks + 1, worker_pb2.WORKER_ROLE_PREFILL)
            s1, _ = await warm(decode, num_blocks + 1, worker_pb2.WORKER_ROLE_DECODE)
            rows = []
            for chunk_bytes in args.chunk_bytes:
                per_chunk = max(1, chunk_bytes // bytes_per_block)
                for int8 in (False, True) if args.int8 else (False,):
                    kv_s, kv_wall, loop_s = [], [], []
                    nbytes = 0
                    await transfer_once(prefill, decode, (s0, s1), workers[0].address, num_blocks, per_chunk, int8)
                    await loopback_once(cl, num_blocks * bytes_per_block, per_chunk * bytes_per_block)
                    label = f"chunk {per_chunk * bytes_per_block / 2**20:.2f} MiB{' int8' if int8 else ''}"
                    for _ in tqdm(range(args.repeats), desc=label):
                        wall, inner, nbytes = await transfer_once(
                            prefill, decode, (s0, s1), workers[0].address, num_blocks, per_chunk, int8
                        )
                        kv_wall.append(wall)
                        kv_s.append(inner)
                        # NOTE: the baseline carries the raw KV's bytes (what an int8 transfer
                        # would have sent without quantization), in chunks of the same blocks.
                        loop_s.append(
                            await loopback_once(cl, num_blocks * bytes_per_block, per_chunk * bytes_per_block)
                        )
                    raw_bytes = num_blocks * bytes_per_block
                    kv_bw = raw_bytes / statistics.median(kv_wall)
                    loop_bw = raw_bytes / statistics.median(loop_s)
                    rows.append(
                        {
                            "chunk_bytes": per_chunk * bytes_per_block,
                            "int8": int8,
                            "kv_bytes": raw_bytes,
                            "wire_bytes": nbytes,
                            "kv_wall_s_median": statistics.median(kv_wall),
                            "kv_pull_s_median": statistics.median(kv_s),
                            "loopback_s_median": statistics.median(loop_s),
                            "kv_GBps": kv_bw / 1e9,
                            "loopback_GBps": loop_bw / 1e9,
                            "ratio": kv_bw / loop_bw,
                        }
                    )
            return {
                "model": args.model,
                "tokens": args.tokens,
                "block_size": info.block_size,
                "num_blocks": num_blocks,
                "bytes_per_block": bytes_per_block,
                "dtype": info.dtype,
                "threads": args.threads,
                "repeats": args.repeats,
                "rows": rows,
            }
    finally:
        loop_proc.kill()
        loop_proc.wait()
        for w in workers:
            w.stop()


def table(result: dict) -> str:
    head = (
        f"{result['model']} ({result['dtype']}), {result['tokens']} tokens = {result['num_blocks']} blocks of "
        f"{result['bytes_per_block'] / 1024:.0f} KiB, median of {result['repeats']}"
    )
    rows = [
        {
            "chunk": f"{r['chunk_bytes'] / 2**20:.2f} MiB",
            "int8": "yes" if r["int8"] else "no",
            "KV MiB": r["kv_bytes"] / 2**20,
            "wire MiB": r["wire_bytes"] / 2**20,
            "transfer ms (offer + pull)": r["kv_wall_s_median"] * 1e3,
            "loopback ms": r["loopback_s_median"] * 1e3,
            "transfer GB/s": r["kv_GBps"],
            "loopback GB/s": r["loopback_GBps"],
            "transfer / loopback": r["ratio"],
        }
        for r in result["rows"]
    ]
    one = "{:.1f}"
    formats = {"KV MiB": one, "wire MiB": one, "transfer ms (offer + pull)": one, "loopback ms": one}
    formats |= {"transfer GB/s": "{:.2f}", "loopback GB/s": "{:.2f}", "transfer / loopback": "{:.0%}"}
    return head + "\n\n" + format_table(rows, formats=formats)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="opt-125m", help="dummy preset the two workers serve")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of KV per transfer")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        nargs="+",
        default=[2**20, 4 * 2**20, 16 * 2**20],
        help="bytes per streamed chunk (rounded to blocks)",
    )
    parser.add_argument("--int8", action="store_true", help="also transfer int8-quantized")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--serve-loopback", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_loopback:
        asyncio.run(serve_loopback())
        return
    result = asyncio.run(run(args))
    print(table(result))
    if args.json:
        write_json(result, args.json, indent=2, quiet=True)


if __name__ == "__main__":
    main()
