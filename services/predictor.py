"""`sluice predictor`: train, export, eval and serve the output-length predictor.

    sluice predictor train --out DIR [--limit-per-source N] [--max-input-tokens 128] [--precision fp32|int8]
    sluice predictor export --model DIR [--out DIR2]     encoder + head as ONNX, checked against torch
    sluice predictor eval --model DIR --prompts FILE --json OUT [--split test|all] [--first-turn-only]
    sluice predictor serve [--model DIR] [--port 50071] [--redis-url redis://127.0.0.1:6379/0]

Without --model the committed directory (predictor_service/model) is used; its encoder is
exported into the cache at first use (artefacts.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.common.config import add_config_arguments, config_from, opt
from sluice.common.security import SecurityConfig, ServerSecurity, redact_url, setup_logging

DEFAULT_PORT = 50071


def _train_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the head, fit the blend, evaluate on the held-out split, write DIR")
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--limit-per-source", type=int, help="samples per prompt file (small runs)")
    p.add_argument("--max-input-tokens", type=int, default=128, help="encoder input cap (128-256)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "int8"), help="of the served encoder export")
    p.add_argument("--encoder-layers", type=int, default=2, help="MiniLM layers kept (1-6; fewer: faster)")
    p.add_argument(
        "--point", default="median", choices=("median", "mode_bin"), help="point estimate: median or most probable bin"
    )
    p.add_argument(
        "--sharegpt-first-turn-only", action="store_true", help="ShareGPT: train and test on first human -> gpt pairs"
    )
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _eval_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy and latency on a ShareGPT / AlpacaEval / Code Alpaca / Sluice JSONL file")
    p.add_argument("--model", help="model directory (default: the committed one)")
    p.add_argument("--prompts", required=True, help="prompt file with responses")
    p.add_argument("--json", required=True, help="write the report here (and the error model beside it)")
    p.add_argument("--split", default="test", choices=("test", "all"), help="test: only the held-out groups")
    p.add_argument("--first-turn-only", action="store_true", help="ShareGPT: the first human -> gpt pair only")
    p.add_argument("--limit", type=int, help="evaluate a random subset of this many samples")
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads (1 = one CPU core)")
    p.add_argument("--precision", choices=("fp32", "int8"), help="encoder precision (default: the model's)")
    p.add_argument("--no-progress", action="store_true")


@dataclass
class PredictorServeConfig(SecurityConfig):
    """`sluice predictor serve`: its flags and SLUICE_* variables come from these fields (and the
    security every server shares: api_key, tls_cert, tls_key, tls_ca, health_port)."""

    model: str | None = opt(None, "model directory; none: the committed one")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(DEFAULT_PORT, "port to listen on (0 picks a free one)")
    redis_url: str | None = opt(None, "Redis URL (redis://host:6379/0); none: an in-process cache, no persistence")
    cache_ttl_s: float = opt(3600.0, "seconds an exact-match cache entry lives (with jitter)")
    redis_timeout_ms: float = opt(50.0, "socket and connect timeout of each Redis call (the fail-open budget)")
    batch_window_ms: float = opt(1.0, "requests arriving within this window are encoded as one batch")
    threads: int = opt(1, "onnxruntime intra-op threads")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port")
    device: str = opt("auto", "auto, cpu or cuda (onnxruntime's CUDA provider when present)")
    precision: str | None = opt(None, "encoder precision, fp32 or int8; none: the model's")
    served_tokenizer: str | None = opt(None, "tokenizer.json token-id prompts are decoded with; none: the demo models'")


def _serve_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gRPC PredictorService")
    p.add_argument("--config", help="settings file: JSON, or TOML (.toml); keys are the settings' field names")
    add_config_arguments(p, PredictorServeConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice predictor", description="The output-length predictor.")
    sub = parser.add_subparsers(dest="action", required=True)
    _train_args(sub)
    p = sub.add_parser("export", help="export encoder and head to ONNX (IR 10) and check the encoder against torch")
    p.add_argument("--model", help="model directory (default: the committed one)")
    p.add_argument("--out", help="write a self-contained copy here (default: the encoder goes into the cache)")
    _eval_args(sub)
    _serve_args(sub)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from predictor_service.train import TrainConfig, train

    cfg = TrainConfig(
        max_input_tokens=args.max_input_tokens,
        precision=args.precision,
        encoder_layers=args.encoder_layers,
        point=args.point,
        sharegpt_first_turn_only=args.sharegpt_first_turn_only,
        limit_per_source=args.limit_per_source,
        epochs=args.epochs,
        seed=args.seed,
        progress=not args.no_progress,
    )
    metrics = train(args.out, cfg)
    for name, sub in metrics["test"].items():
        b, h, r = sub["blend"], sub["head"], sub["retrieval"]
        accuracy = (
            f"blend {b['bucket_accuracy']:.3f} head {h['bucket_accuracy']:.3f} retrieval {r['bucket_accuracy']:.3f}"
        )
        print(
            f"{name:>20} n={sub['n']:>5}  bucket_accuracy {accuracy}  "
            f"mae {b['mae_tokens']:.1f}  spearman {b['spearman']:.3f}"
        )
    print(f"blend {metrics['blend']}; wrote {args.out} ({metrics['version']})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from predictor_service import artefacts
    from predictor_service.export import check_encoder, export_encoder

    src = Path(args.model) if args.model else artefacts.default_model_dir()
    config = artefacts.read_config(src)
    enc = config["encoder"]
    if args.out:
        out = Path(args.out)
        if out.resolve() != src.resolve():
            shutil.copytree(src, out, dirs_exist_ok=True)
        path = export_encoder(
            out / artefacts.ENCODER_FILE, enc["max_input_tokens"], enc["precision"], artefacts.encoder_layers(config)
        )
    else:
        path = artefacts.encoder_path(src)
    tolerance = 1e-4 if enc["precision"] == "fp32" else 1.0
    diff = check_encoder(path, enc["max_input_tokens"], tolerance, artefacts.encoder_layers(config))
    print(f"encoder {path} ({enc['precision']}): max |onnx - torch| = {diff:.2e} on a padded batch")
    print(f"head {src / artefacts.HEAD_FILE}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from predictor_service.evaluate import evaluate

    report, error_model = evaluate(
        args.model,
        args.prompts,
        split=args.split,
        first_turn_only=args.first_turn_only,
        limit=args.limit,
        latency_samples=args.latency_samples,
        threads=args.threads,
        precision=args.precision,
        progress=not args.no_progress,
    )
    for key in ("bucket_accuracy", "mae_tokens", "spearman", "p50_ms", "p99_ms", "cached_p50_ms"):
        print(f"{key:>16}: {report[key]:.4g}")
    print(
        f"{'n':>16}: {report['n']} ({report['split']}), {report['precision']} encoder on {report['provider']}, "
        f"{report['threads']} thread(s)"
    )
    out = Path(args.json)
    out.write_text(json.dumps(report, indent=2))
    error_path = error_model.save(out.with_suffix(".error_model.json"))
    print(f"wrote {out} and {error_path}")
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from predictor_service.engine import EngineConfig
    from predictor_service.server import build_engine, start_server
    from sluice.common.telemetry import setup_tracing

    # NOTE: before the server is built: its OpenTelemetry interceptor comes with tracing (as the
    # scheduler's and the worker's); nothing is installed unless the OTEL_* variables ask for it.
    setup_tracing("sluice-predictor")
    cfg = config_from(PredictorServeConfig, args, file=args.config)
    if cfg.device not in ("auto", "cpu", "cuda") or cfg.precision not in (None, "fp32", "int8"):
        raise ValueError(f"--device must be auto, cpu or cuda and --precision fp32 or int8, got {cfg}")
    config = EngineConfig(
        redis_url=cfg.redis_url,
        cache_ttl_s=cfg.cache_ttl_s,
        redis_timeout_s=cfg.redis_timeout_ms / 1e3,
        batch_window_s=cfg.batch_window_ms / 1e3,
        served_tokenizer=cfg.served_tokenizer,
    )
    engine = build_engine(cfg.model, config, threads=cfg.threads, device=cfg.device, precision=cfg.precision)
    if cfg.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(cfg.metrics_port, addr=cfg.host, registry=engine.metrics.registry)
    security = ServerSecurity.from_config(cfg)
    server = await start_server(engine, cfg.host, cfg.port, security=security, health_port=cfg.health_port)
    log = logging.getLogger("sluice.predictor")
    provider, redis = engine.predictor.provider, redact_url(cfg.redis_url or "none")
    log.info("predictor listening on %s:%d (provider %s, redis %s)", cfg.host, server.port, provider, redis)
    print(f"sluice predictor listening on {cfg.host}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s=2.0)
    await engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.INFO)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commands = {"train": cmd_train, "export": cmd_export, "eval": cmd_eval}
    try:
        if args.action == "serve":
            return asyncio.run(_serve(args))
        return commands[args.action](args)
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
