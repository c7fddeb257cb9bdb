"""`sluice generate "prompt"`: stream one completion from a running scheduler to stdout.

    argv --> SluiceClient.generate (text prompt, sampling, SLOs) --> text deltas on stdout
         --> on the last message: finish reason, usage and the server's timings on stderr

Exit status: 0 when the request finished (stop or length), 1 when the server ended it
otherwise (timeout, rejected, error, abort), 2 on a gRPC error (bad input, no server).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from sluice.common.security import add_client_security_arguments, client_security_from, explain_unavailable

DEFAULT_TARGET = os.environ.get("SLUICE_TARGET", "127.0.0.1:50051")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="stream one completion from a running scheduler")
    p.add_argument("prompt", help="prompt text (or comma-separated token ids with --token-ids)")
    p.add_argument(
        "--target", default=DEFAULT_TARGET, help="scheduler HOST:PORT (default $SLUICE_TARGET or %(default)s)"
    )
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ttft-ms", type=float, help="time-to-first-token SLO")
    p.add_argument("--tbt-ms", type=float, help="time-between-tokens SLO")
    p.add_argument("--jct-ms", type=float, help="job completion time SLO")
    p.add_argument("--slo-class", choices=("online", "offline"))
    p.add_argument("--priority", type=int, default=0, help="lower is served first")
    p.add_argument("--timeout", type=float, help="deadline of the whole request in seconds")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    add_client_security_arguments(p)
    p.set_defaults(func=run)


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if not args.token_ids:
        return args.prompt
    return [int(t) for t in args.prompt.replace(" ", "").split(",") if t]


async def _generate(args: argparse.Namespace) -> int:
    import grpc

    from sluice.common.client import SluiceClient

    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ttft_ms": args.ttft_ms,
        "tbt_ms": args.tbt_ms,
        "jct_ms": args.jct_ms,
        "slo_class": args.slo_class,
        "priority": args.priority,
    }
    async with SluiceClient(args.target, security=client_security_from(args)) as client:
        try:
            async for chunk in client.generate(_prompt(args), timeout=args.timeout, **options):
                if chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                if chunk.is_last:
                    sys.stdout.write("\n")
                    if not args.quiet:
                        print(_summary(chunk), file=sys.stderr)
                    return 0 if chunk.finish_reason in ("stop", "length") else 1
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                details = explain_unavailable(details, client.security)
            print(f"\nerror: {exc.code().name}: {details}", file=sys.stderr)
            return 2
    print("\nerror: the stream ended without a final message", file=sys.stderr)
    return 1


def _summary(chunk: Any) -> str:
    parts = [f"[{chunk.finish_reason}] {chunk.prompt_tokens} prompt + {chunk.completion_tokens} output tokens"]
    t = chunk.timings
    if t is not None:
        parts.append(
            f"queue {t.queue_s * 1e3:.0f} ms, TTFT {t.ttft_s * 1e3:.0f} ms, mean TBT {t.mean_tbt_s * 1e3:.1f} ms, "
            f"JCT {t.jct_s * 1e3:.0f} ms, preemptions {t.num_preemptions}, SLO {'met' if t.slo_met else 'missed'}"
        )
    if chunk.message:
        parts.append(chunk.message)
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_generate(args))
    except KeyboardInterrupt:
        return 130
