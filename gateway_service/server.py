"""Serving the gateway app with uvicorn: in-process (`GatewayServer`, for `sluice serve`'s tests
and the benchmark) or as the `sluice gateway` command.

    sluice gateway --scheduler HOST:PORT [--port 8000] [--api-key KEY] [--tls-cert C --tls-key K [--tls-ca CA]]
        -> uvicorn (httptools parser, uvloop) serving gateway_service.app on HOST:PORT
        -> prints "sluice gateway listening on HOST:PORT ..." once bound (what `sluice serve`
           waits for when it starts the gateway as its child), serves until SIGINT/SIGTERM

TLS is uvicorn's: tls_cert and tls_key serve HTTPS; with tls_ca, clients must present a
certificate it signed (mutual TLS), as on the scheduler's gRPC port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway_service.config import GATEWAY_EXCLUDES, GatewayConfig
from sluice.common.config import add_config_arguments, config_from

if TYPE_CHECKING:
    from gateway_service.app import Gateway

# NOTE: the app (Starlette, uvicorn) is imported where it is served: the `sluice` command builds
# its flags from this module, and the scheduler's image has no HTTP stack.


def uvicorn_config(cfg: GatewayConfig, gateway: Gateway, *, loop: str = "none") -> Any:
    import uvicorn

    from gateway_service.app import build_app
    from gateway_service.http_protocol import GatewayHttpProtocol

    tls: dict[str, Any] = {}
    if cfg.tls_cert or cfg.tls_key:
        if not (cfg.tls_cert and cfg.tls_key):
            raise ValueError("tls_cert and tls_key: give both (a certificate and its private key) or neither")
        tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
        if cfg.tls_ca:
            tls |= {"ssl_ca_certs": cfg.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    # NOTE: httptools (llhttp, in C) parses a request in a few microseconds where h11 (pure
    # Python) takes tens (GatewayHttpProtocol is uvicorn's httptools protocol, a response's head
    # written with its first body bytes); access logs off: one line per request is the slowest
    # part of a request.
    return uvicorn.Config(
        build_app(gateway),
        host=cfg.host,
        port=cfg.port,
        loop=loop,
        http=GatewayHttpProtocol,
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # NOTE: nothing here reads the client's address; one layer less per request
        log_level="warning",
        timeout_graceful_shutdown=5,
        **tls,
    )


@dataclass
class GatewayServer:
    """A gateway served on the running event loop; `port` is the bound one."""

    server: Any
    task: asyncio.Task
    gateway: Gateway
    port: int

    @classmethod
    async def start(cls, cfg: GatewayConfig, gateway: Gateway | None = None) -> GatewayServer:
        import uvicorn

        from gateway_service.app import Gateway

        gateway = gateway or Gateway(cfg)
        server = uvicorn.Server(uvicorn_config(cfg, gateway))
        server.capture_signals = contextlib.nullcontext  # the host process owns its signals
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError(f"the gateway could not start on {cfg.host}:{cfg.port}")
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return cls(server, task, gateway, port)

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="settings file: JSON, or TOML (.toml); keys are the settings' field names")
    add_config_arguments(p, GatewayConfig, exclude=GATEWAY_EXCLUDES)


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway_service.app import Gateway
    from sluice.common.telemetry import setup_tracing

    cfg = config_from(GatewayConfig, args, file=args.config, exclude=GATEWAY_EXCLUDES)
    setup_tracing("sluice-gateway")
    try:
        server = uvicorn.Server(uvicorn_config(cfg, Gateway(cfg), loop="uvloop"))
        server.capture_signals = contextlib.nullcontext  # graceful stop on SIGINT/SIGTERM, exit code 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scheme = "https" if cfg.tls_cert else "http"

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(
            f"sluice gateway listening on {host}:{port} (OpenAI API at {scheme}://{host}:{port}/v1; "
            f"scheduler {cfg.scheduler})",
            flush=True,
        )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        watcher = asyncio.create_task(announce())
        await server.serve()
        watcher.cancel()

    import uvloop

    uvloop.run(main())
    return 0 if server.started else 1
