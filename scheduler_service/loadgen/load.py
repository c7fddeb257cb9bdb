"""The load: every request sent at its arrival time (open loop) or a fixed number at a time
(closed loop), over the scheduler's gRPC API or an OpenAI-compatible backend (openai_backend.py).
Times are client-side: seconds since the run started, when sent and when each token arrived."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler_service.loadgen.requests import BenchRequest, RequestRecord

if TYPE_CHECKING:
    from scheduler_service.loadgen.openai_backend import OpenAIBench
    from sluice.common.client import SluiceClient


def _slo_ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


async def send_grpc(client: SluiceClient, record: RequestRecord, t0: float, timeout: float | None) -> None:
    import grpc

    from sluice.common.client import build_request

    r = record.request
    msg = build_request(
        r.prompt,
        request_id=r.request_id,
        max_tokens=r.max_tokens,
        ignore_eos=r.ignore_eos,
        ttft_ms=_slo_ms(r.slo.ttft_s),
        tbt_ms=_slo_ms(r.slo.tbt_s),
        jct_ms=_slo_ms(r.slo.jct_s),
        priority=r.priority,
        tenant=r.tenant,
    )
    record.sent_s = time.perf_counter() - t0
    try:
        async for chunk in client.generate_request(msg, timeout=timeout):
            if chunk.token_ids:
                record.token_times.extend([chunk.received_s - t0] * len(chunk.token_ids))
            if chunk.is_last:
                record.finish_reason = chunk.finish_reason
                record.prompt_tokens = chunk.prompt_tokens
                record.timings = chunk.timings
                record.message = chunk.message
    except grpc.aio.AioRpcError as exc:
        record.error_code = exc.code().name
        record.message = exc.details() or ""
    finally:
        record.end_s = time.perf_counter() - t0


async def run_requests(
    client: SluiceClient | OpenAIBench,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    timeout: float | None = None,
    progress: bool = True,
) -> list[RequestRecord]:
    """Sends every request (open loop at its `arrival_s`, or `concurrency` at a time) and
    returns their records in the order given."""
    from tqdm import tqdm

    from sluice.common.client import SluiceClient

    records = [RequestRecord(r) for r in requests]
    bar = tqdm(total=len(records), desc="bench", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()

    async def send(record: RequestRecord) -> None:
        if isinstance(client, SluiceClient):
            await send_grpc(client, record, t0, timeout)
        else:
            await client.send(record, t0, timeout)
        bar.update(1)

    if concurrency is not None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        pending = iter(records)

        async def lane() -> None:
            for record in pending:
                await send(record)

        await asyncio.gather(*(lane() for _ in range(min(concurrency, len(records)))))
    else:
        if any(r.arrival_s is None for r in requests):
            raise ValueError("the workload has no arrival times: give a rate or a concurrency")
        tasks = []
        for record in sorted(records, key=lambda rec: rec.request.arrival_s or 0.0):
            delay = (record.request.arrival_s or 0.0) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(record)))
        await asyncio.gather(*tasks)
    bar.close()
    return records
