"""`sluice bench`: live load from a trace against a running scheduler, measured by the client,
reported with the simulator's metric definitions. `--backend openai --base-url URL` sends the
same requests, at the same arrival times, to any OpenAI-compatible server instead:
`sluice serve` over HTTP, `vllm serve`, SGLang ... This module reads the flags and runs the
load generator of scheduler_service/loadgen/:

    load_trace (+ apply_arrivals / SLOs) --prepare_requests--> BenchRequests (lengths clipped
        to the server's max_model_len; token-id prompts, or the trace's text)   loadgen/requests.py
    --run_requests--> open loop (each request sent at its arrival time) or closed loop
        (--concurrency C streams at a time) --> one RequestRecord per request (send time,
        receive time of every token, finish reason, server timings, gRPC error)   loadgen/load.py
    --summarize--> MetricsRecorder (scheduler_service.core.metrics, the simulator's) fed with
        Requests rebuilt from the records --> the `sluice simulate --json` document   loadgen/measure.py

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler_service.loadgen.requests import PROMPT_SOURCES
from sluice.common.security import add_client_security_arguments, client_security_from

if TYPE_CHECKING:
    from scheduler_service.loadgen.openai_backend import OpenAIBench
    from scheduler_service.loadgen.requests import BenchRequest, RequestRecord
    from scheduler_service.workloads import Workload
    from sluice.common.client import SluiceClient

DEFAULT_TARGET = os.environ.get("SLUICE_TARGET", "127.0.0.1:50051")
BACKENDS = ("grpc", "openai")


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
    from scheduler_service.loadgen.load import run_requests
    from scheduler_service.loadgen.requests import prepare_requests
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
        from scheduler_service.loadgen.openai_backend import OpenAIBench

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
    from scheduler_service.loadgen.measure import summarize
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
