"""`sluice worker`: one worker service over an engine of the registry (worker_service/engines.py).

    sluice worker --model tiny-llama --port 50061 [--device cuda] [--engine torch|vllm|echo]
    sluice worker ... --role prefill|decode|mixed     (its part in a disaggregated deployment)

Its flags (and SLUICE_<NAME> variables) are WorkerConfig's fields: the engine's (EngineConfig),
the Warmup defaults (WarmupDefaults), the security every server shares (SecurityConfig: api_key,
tls_cert, tls_key, tls_ca, health_port) and the server's own below. Secrets are never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sluice.common.config import add_config_arguments, config_from, opt, subset
from sluice.common.security import ClientSecurity, SecurityConfig, ServerSecurity, redacted, setup_logging
from worker_service.engine_contract import EngineConfig
from worker_service.lease import DEFAULT_LEASE_TTL_S
from worker_service.server import WarmupDefaults, WorkerServerOptions, role_value


@dataclass
class WorkerConfig(SecurityConfig, WarmupDefaults, EngineConfig):
    host: str = opt("127.0.0.1", "address to listen on (loopback unless told otherwise)")
    port: int = opt(50061, "port to listen on (0 picks a free one)")
    lease_ttl_s: float = opt(
        DEFAULT_LEASE_TTL_S, "a scheduler's lease on this worker lapses this long after its last call"
    )
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port (on --host)")
    worker_id: int = opt(0, "this worker's id in the scheduler's logs and traces")
    threads: int = opt(0, "torch intra-op threads on CPU; 0: torch's default")
    engine: str = opt(
        "torch", "torch: our model code; vllm: vLLM's model runner; echo (or none): synthetic tokens, no model"
    )
    echo_step_ms: float = opt(0.0, "with --engine echo: sleep this long per step")
    echo_token_ms: float = opt(0.0, "with --engine echo: and this long per token the step schedules")
    echo_async_device: bool = opt(
        False, "with --echo-step-ms: the step's time is awaited off the CPU, as a GPU's kernels run (not slept)"
    )
    worker_pipeline: str = opt(
        "auto",
        "launch the next step before collecting this one: auto (where the device computes apart from the CPU: "
        "CUDA, --echo-async-device), on or off",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sluice worker", description="Serve one model engine over gRPC.")
    p.add_argument("--config", help="settings file: JSON, or TOML (.toml); keys are the settings' field names")
    add_config_arguments(p, WorkerConfig)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from worker_service.engines import engine_factory
    from worker_service.server import serve

    args = parse_args(argv)
    cfg = config_from(WorkerConfig, args, file=args.config)
    if cfg.worker_pipeline not in ("auto", "on", "off"):
        raise SystemExit(f"error: --worker-pipeline must be auto, on or off, got {cfg.worker_pipeline!r}")
    setup_logging(logging.INFO)
    if cfg.threads:
        # NOTE: on a CPU shared with other processes, fewer OpenMP threads than cores avoids
        # barrier stalls that made the same steps up to 40x slower (docs/results/worker_engine.md).
        torch.set_num_threads(cfg.threads)
    logging.getLogger("sluice.worker").info("worker config: %s", redacted(asdict(cfg)))
    options: dict[str, Any] = {}
    if cfg.engine in ("echo", "none"):
        options = {
            "step_time_s": cfg.echo_step_ms / 1e3,
            "async_device": cfg.echo_async_device,
            "token_time_s": cfg.echo_token_ms / 1e3,
        }
    try:
        factory = engine_factory(cfg.engine, **options)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    engine_config, defaults = subset(EngineConfig, cfg), subset(WarmupDefaults, cfg)
    try:
        role_value(cfg.role)
        security = ServerSecurity.from_config(cfg)
        # NOTE: a decode worker reads a peer's KV (ReadKv) with the deployment's own TLS files
        # and its first API key: workers of one deployment share their security settings.
        peer_key = security.api_keys.keys[0] if security.api_keys is not None else None
        peer = ClientSecurity.from_config(cfg, peer_key)
        options = WorkerServerOptions(
            security, cfg.health_port, cfg.lease_ttl_s, peer_security=peer, pipeline=cfg.worker_pipeline
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    server = serve(
        engine_config,
        cfg.port,
        host=cfg.host,
        worker_id=cfg.worker_id,
        defaults=defaults,
        engine_factory=factory,
        options=options,
        metrics_port=cfg.metrics_port,
    )
    asyncio.run(server)
    return 0
