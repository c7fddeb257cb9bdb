"""`sluice bench`: live load from a trace against a running scheduler, measured by the client,
reported with the simulator's metric definitions. `--backend openai --base-url URL` sends the
same requests, at the same arrival times, to any OpenAI-compatible server instead
(services/bench_openai.py): `sluice serve` over HTTP, `vllm serve`, SGLang ...

    load_trace (+ apply_arrivals / SLOs) --prepare_requests--> BenchRequests (lengths clipped
        to the server's max_model_len; token-id prompts, or the trace's text)
    --run_requests--> open loop (each request sent at its arrival time) or closed loop
        (--concurrency C streams at a time) --> one RequestRecord per request (send time,
        receive time of every token, finish reason, server timings, gRPC error)
    --summarize--> MetricsRecorder (scheduler_service.core.metrics, the simulator's) fed with
        Requests rebuilt from the records --> the `sluice simulate --json` document

Length source. By default no request carries its true output length: `max_tokens` is the
context left after the prompt (capped by `--max-tokens`), `ignore_eos` is off and no predicted
length is sent, so the model decides when to stop and the server's own length source (its
predictor, else max_tokens) is what the policies see; the JSON says `"length_source":
"max_tokens"`. `--oracle-lengths` restores the replay of the simulator: each request asks for
exactly the trace's output length with `ignore_eos` (`"length_source": "oracle"`), which hands
every policy the true length (an upper bound of what a real predictor allows).

Times are client-side: arrival = when the request was sent, a token's time = when its
message arrived. Metrics only the server sees (compute and KV utilization, scheduling
overhead, load imbalance, KV allocation failures) are null here; preemptions come from each
request's final timings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.common.security import add_client_security_arguments, client_security_from

if TYPE_CHECKING:
    from scheduler_service.core.slo import SLOSpec
    from scheduler_service.sim.simulator import SimRun
    from scheduler_service.workloads import Workload
    from services.bench_openai import OpenAIBench
    from sluice.common.client import SluiceClient, Timings

DEFAULT_TARGET = os.environ.get("SLUICE_TARGET", "127.0.0.1:50051")
PROMPT_TOKEN_BASE = 1000  # synthetic prompt ids cycle through [1000, 2000): valid in every vocabulary we serve
PROMPT_TOKEN_SPAN = 1000
SERVER_ONLY_METRICS = ("compute_util_mean", "kv_util_mean", "kv_used_mean", "kv_alloc_failures", "load_imbalance_s")
PROMPT_SOURCES = ("auto", "tokens", "text")
BACKENDS = ("grpc", "openai")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    arrival_s: float | None  # offset from the start of the run; None in closed-loop mode
    prompt: str | tuple[int, ...]
    num_prompt_tokens: int  # the trace's count (the server's tokenizer decides for text prompts)
    max_tokens: int  # oracle: the trace's output length; else the context left (both clipped to --max-tokens)
    slo: SLOSpec
    priority: int = 0
    tenant: str = ""
    ignore_eos: bool = False  # True only with oracle lengths: the request runs to exactly max_tokens


@dataclass(slots=True)
class RequestRecord:
    request: BenchRequest
    sent_s: float = 0.0  # seconds since the run started
    end_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    timings: Timings | None = None
    error_code: str = ""  # gRPC status name when the call failed
    message: str = ""


def synthetic_prompt(num_tokens: int, offset: int) -> tuple[int, ...]:
    """Token ids of a given length; `offset` varies them between requests (no shared prefixes)."""
    return tuple(PROMPT_TOKEN_BASE + (offset * 7919 + i * 31) % PROMPT_TOKEN_SPAN for i in range(num_tokens))


def prepare_requests(
    workload: Workload,
    max_model_len: int,
    *,
    max_tokens: int | None = None,
    prompt_source: str = "auto",
    oracle_lengths: bool = False,
) -> list[BenchRequest]:
    """One BenchRequest per trace request: the prompt clipped to leave room for one output
    token; `max_tokens` the context left (and at most `max_tokens`), or with `oracle_lengths`
    the trace's true output length under the same caps, run with `ignore_eos`. Text prompts
    are used when the trace has them (`auto`, `text`) and they are not longer than the context."""
    from scheduler_service.core.slo import NO_SLO

    if prompt_source not in PROMPT_SOURCES:
        raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, got {prompt_source!r}")
    out = []
    for i, tr in enumerate(workload.requests):
        prompt_len = min(max(1, tr.prompt_tokens), max_model_len - 1)
        room = max_model_len - prompt_len
        cap = min(room, max_tokens or room)
        num_out = max(1, min(tr.output_tokens, cap)) if oracle_lengths else max(1, cap)
        prompt: str | tuple[int, ...]
        if prompt_source != "tokens" and tr.prompt_text and tr.prompt_tokens == prompt_len:
            prompt = tr.prompt_text
        elif prompt_source == "text":
            raise ValueError(f"request {tr.request_id!r} has no prompt text that fits {max_model_len} tokens")
        else:
            prompt = synthetic_prompt(prompt_len, i)
        out.append(
            BenchRequest(
                request_id=f"bench-{i}-{tr.request_id}",
                arrival_s=tr.arrival_s,
                prompt=prompt,
                num_prompt_tokens=prompt_len,
                max_tokens=num_out,
                slo=tr.slo or NO_SLO,
                priority=tr.priority,
                tenant=tr.tenant,
                ignore_eos=oracle_lengths,
            )
        )
    return out


# ---------------------------------------------------------------- the load


def _slo_ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


async def _send(client: SluiceClient, record: RequestRecord, t0: float, timeout: float | None) -> None:
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
            await _send(client, record, t0, timeout)
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


# ---------------------------------------------------------------- the metrics


def _reject_reason(message: str) -> Any:
    from scheduler_service.core.preemption import RejectReason

    return next((r for r in RejectReason if r.value in message), RejectReason.QUEUE_FULL)


def _final_status(record: RequestRecord) -> Any:
    from scheduler_service.core.request import RequestStatus

    if record.error_code:
        return (
            RequestStatus.FINISHED_TIMEOUT if record.error_code == "DEADLINE_EXCEEDED" else RequestStatus.FINISHED_ERROR
        )
    by_reason = {
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH,
        "abort": RequestStatus.FINISHED_ABORTED,
        "timeout": RequestStatus.FINISHED_TIMEOUT,
    }
    status = by_reason.get(record.finish_reason or "", RequestStatus.FINISHED_ERROR)
    if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and not record.token_times:
        return RequestStatus.FINISHED_ERROR  # a completion without a token cannot be measured
    return status


def _is_rejected(record: RequestRecord) -> bool:
    return record.error_code == "RESOURCE_EXHAUSTED" or record.finish_reason == "rejected"


def record_metrics(records: Sequence[RequestRecord]) -> Any:
    """A MetricsRecorder fed with one rebuilt Request per record (the simulator's definitions)."""
    from scheduler_service.core.metrics import MetricsRecorder
    from scheduler_service.core.request import Request, RequestStatus
    from sluice.contract.sampling import SamplingParams

    recorder = MetricsRecorder()
    for rec in records:
        r = rec.request
        request = Request(
            r.request_id,
            arrival_time=rec.sent_s,
            num_prompt_tokens=rec.prompt_tokens or r.num_prompt_tokens,
            sampling=SamplingParams(max_tokens=r.max_tokens),
            slo=r.slo,
            priority=r.priority,
            tenant=r.tenant,
        )
        if _is_rejected(rec):
            request.status = RequestStatus.FINISHED_REJECTED
            recorder.on_reject(request, _reject_reason(rec.message), rec.end_s)
            continue
        recorder.on_admitted(request)
        request.token_times = array("d", rec.token_times)
        request.num_output_tokens = len(rec.token_times)
        if rec.timings is not None:
            request.queue_time = rec.timings.queue_s
            request.num_preemptions = rec.timings.num_preemptions
            if rec.timings.num_preemptions:
                recorder.preemptions[("unknown", "unknown")] += rec.timings.num_preemptions
        request.status = _final_status(rec)
        recorder.on_finish(request, rec.token_times[-1] if rec.token_times else rec.end_s)
    return recorder


def summarize(
    records: Sequence[RequestRecord], *, policy: str, workload: str, config: dict[str, Any] | None = None
) -> SimRun:
    """The run as a SimRun: `metrics` has exactly the simulator's keys (server-only ones null),
    `details` the recorder's details plus the client's view (errors by gRPC code)."""
    from scheduler_service.sim.simulator import SimRun

    recorder = record_metrics(records)
    metrics = recorder.summary()
    for key in SERVER_ONLY_METRICS:
        metrics[key] = None
    metrics["sched_overhead_ms"] = {"mean": None, "p99": None}
    details = recorder.details()
    details["client"] = {
        "errors_by_code": dict(Counter(r.error_code for r in records if r.error_code)),
        "finish_reasons": dict(Counter(r.finish_reason for r in records if r.finish_reason)),
        "measured_by": "client",
    }
    return SimRun(policy=policy, workload=workload, config=dict(config or {}), metrics=metrics, details=details)


# ---------------------------------------------------------------- the command


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="live load from a trace against a running scheduler (simulate's metrics)")
    p.add_argument(
        "--target", default=DEFAULT_TARGET, help="scheduler HOST:PORT (default $SLUICE_TARGET or %(default)s)"
    )
    p.add_argument(
        "--backend",
        default="grpc",
        choices=BACKENDS,
        help="grpc: the scheduler's Generation API at --target; openai: POST /v1/completions at --base-url",
    )
    p.add_argument("--base-url", help="openai backend: the API's base URL, like http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="openai backend: the model to ask for (default: the first the server lists)")
    p.add_argument(
        "--max-model-len", type=int, help="openai backend: the context length, where /v1/models does not list it"
    )
    p.add_argument("--trace", required=True, help="a shared trace name, a synthetic workload name, or a file path")
    p.add_argument("--num-requests", type=int, default=100)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, help="arrivals/s: rescales trace timestamps, or Poisson")
    mode.add_argument("--concurrency", type=int, help="closed loop: this many requests in flight")
    p.add_argument("--arrival", default="auto", choices=["auto", "trace", "poisson", "gamma"])
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, help="cap of every request's max_tokens")
    p.add_argument(
        "--oracle-lengths",
        action="store_true",
        help="ask for exactly each request's true output length with ignore_eos (hands policies the oracle)",
    )
    p.add_argument("--prompt-source", default="auto", choices=PROMPT_SOURCES, help="auto: text when the trace has it")
    p.add_argument("--ttft-ms", type=float, help="a TTFT SLO for every request")
    p.add_argument("--tbt-ms", type=float, help="a TBT SLO for every request")
    p.add_argument("--jct-ms", type=float, help="a JCT SLO for every request")
    add_client_security_arguments(p)
    p.add_argument("--timeout", type=float, help="deadline of each request in seconds")
    p.add_argument("--json", help="write the metrics JSON (the format of `sluice simulate --json`)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _workload(args: argparse.Namespace) -> Workload:
    from scheduler_service.core.slo import SLOSpec
    from scheduler_service.workloads import apply_arrivals, load_trace

    workload = load_trace(args.trace, num_requests=args.num_requests, seed=args.seed)
    if args.concurrency is None and (args.rate is not None or not workload.has_arrivals):
        if args.rate is None:
            raise ValueError(f"trace {args.trace!r} has no arrival times; give --rate or --concurrency")
        workload = apply_arrivals(workload, args.arrival, rate=args.rate, cv=args.cv, seed=args.seed)
    if args.ttft_ms or args.tbt_ms or args.jct_ms:
        slo = SLOSpec(*(v / 1e3 if v else None for v in (args.ttft_ms, args.tbt_ms, args.jct_ms)))
        slo.validate()
        workload = workload.with_slos([slo] * len(workload), "bench flags")
    return workload


def _max_tokens_policy(args: argparse.Namespace) -> str:
    cap = f", at most {args.max_tokens}" if args.max_tokens else ""
    if args.oracle_lengths:
        return f"max_tokens = the trace's output length{cap}, ignore_eos"
    return f"max_tokens = the context left after the prompt{cap}; the model stops at EOS; no predicted length sent"


@dataclass(frozen=True)
class Served:
    """What the bench knows of the server it loads."""

    target: str
    model: str
    policy: str
    router: str | None
    num_workers: int | None
    max_model_len: int


async def _load(
    args: argparse.Namespace, workload: Workload
) -> tuple[Served, list[BenchRequest], list[RequestRecord], float]:
    """Prepares the requests for the server's context and runs them against it."""
    from sluice.common.client import SluiceClient

    def prepare(max_model_len: int) -> list[BenchRequest]:
        return prepare_requests(
            workload,
            max_model_len,
            max_tokens=args.max_tokens,
            prompt_source=args.prompt_source,
            oracle_lengths=args.oracle_lengths,
        )

    security = client_security_from(args)
    client: SluiceClient | OpenAIBench
    if args.backend == "openai":
        from services.bench_openai import OpenAIBench

        if not args.base_url:
            raise ValueError("--backend openai needs --base-url (like http://127.0.0.1:8000/v1)")
        client = OpenAIBench(args.base_url, security.api_key, args.model)
        async with client:
            model, context = await client.describe(args.max_model_len)
            served = Served(args.base_url, model, "openai-api", None, None, context)
            requests = prepare(context)
            start = time.perf_counter()
            records = await run_requests(
                client, requests, concurrency=args.concurrency, timeout=args.timeout, progress=not args.no_progress
            )
            return served, requests, records, time.perf_counter() - start
    async with SluiceClient(args.target, security=security) as client:
        info = await client.server_info()
        served = Served(args.target, info.model, info.policy, info.router, len(info.workers), info.max_model_len)
        requests = prepare(info.max_model_len)
        start = time.perf_counter()
        records = await run_requests(
            client, requests, concurrency=args.concurrency, timeout=args.timeout, progress=not args.no_progress
        )
        return served, requests, records, time.perf_counter() - start


async def _bench(args: argparse.Namespace) -> int:
    from scheduler_service.sim.report import format_table, write_json

    workload = _workload(args)
    length_source = "oracle" if args.oracle_lengths else "max_tokens"
    print(f"length source: {length_source} ({_max_tokens_policy(args)})")
    served, requests, records, wall = await _load(args, workload)
    config = {
        "mode": "live",
        "backend": args.backend,
        "target": served.target,
        "model": served.model,
        "router": served.router,
        "num_workers": served.num_workers,
        "max_model_len": served.max_model_len,
        "rate": args.rate,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "wall_s": wall,
        "length_source": length_source,
        "max_tokens_policy": _max_tokens_policy(args),
    }
    run = summarize(records, policy=served.policy, workload=workload.name, config=config)
    print(f"{workload.name}: {len(requests)} requests against {served.target} ({served.model}, {served.policy})")
    print(format_table([run]))
    rejected = run.details["rejected_by_reason"]
    if rejected:
        print(f"rejected {sum(rejected.values())} (" + ", ".join(f"{k}: {v}" for k, v in rejected.items()) + ")")
    errors = run.details["client"]["errors_by_code"]
    if errors:
        print("errors: " + ", ".join(f"{k}: {v}" for k, v in errors.items()))
    if args.json:
        write_json([run], args.json)
        print(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_bench(args))
    except KeyboardInterrupt:
        return 130
