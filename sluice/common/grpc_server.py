"""One gRPC server bootstrap for every Sluice service (scheduler, worker, predictor).

    server = GrpcServer.build(SERVICE_NAME, add_servicers, host, port, security=..., health_port=...)
        grpc.aio server with server_options (message limits, keepalive)
        + GuardInterceptor first (API keys; malformed requests -> INVALID_ARGUMENT, no traceback)
        + OpenTelemetry interceptor when tracing is set up
        + standard health (`""` = liveness, SERVICE_NAME = readiness) and reflection (v1 and v1alpha)
        + TLS, mutual when the security names a CA
        + with health_port: a second, plaintext server with only the health service (same
          statuses), for orchestrator probes that cannot present a client certificate
    await server.start(ready=False)     liveness SERVING, readiness as given
    await server.set_ready(True)        readiness follows the service's own state
    await server.stop(grace_s)          health NOT_SERVING first, a moment, then in-flight calls get grace_s

Channel options for the clients of these servers (the scheduler's worker streams, the
predictor client, the Python client) come from the same `Keepalive` value as the server's,
so both ends of a connection agree on message limits and on how often pings may come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.common.interceptors import GuardInterceptor
from sluice.common.reflection import enable_reflection
from sluice.common.security import ServerSecurity
from sluice.common.telemetry import grpc_server_interceptors, tracing_enabled

# NOTE: plans with many new long prompts exceed gRPC's 4 MiB default (256 prompts of 8k
# tokens are ~6 MiB of varints); KV never travels in these messages, so 64 MiB is ample.
MAX_MESSAGE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Keepalive:
    """Keepalive of both ends of a long-lived connection, consistent by construction.

    A server answers a ping that comes sooner than `min_ping_interval_s` after the previous
    one (with no data between) with a strike, and after two strikes closes the connection
    with GOAWAY "too_many_pings"; every client pings every `client_time_s`, twice that
    interval, so jitter can never make a ping early. Servers ping idle clients every
    `server_time_s`; an unanswered ping closes the connection after `timeout_s`, so a dead
    peer is noticed in seconds, not at the OS TCP timeout.

    NOTE: the server option is `grpc.http2.min_ping_interval_without_data_ms`. Sluice used to
    set `grpc.http2.min_recv_ping_interval_without_data_ms`, a name gRPC does not know, so the
    default of 5 minutes applied: the scheduler's idle worker streams (pinged every 10 s) were
    closed with GOAWAY after three pings, and the first request after a minute idle failed.
    """

    min_ping_interval_s: float = 10.0
    server_time_s: float = 30.0
    timeout_s: float = 10.0

    @property
    def client_time_s(self) -> float:
        return 2 * self.min_ping_interval_s

    def server_options(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
        return (
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", _ms(self.server_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_ping_interval_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        )

    def channel_options(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
        return (
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", _ms(self.client_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


KEEPALIVE = Keepalive()
SERVER_OPTIONS = KEEPALIVE.server_options()
CHANNEL_OPTIONS = KEEPALIVE.channel_options()

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class GrpcServer:
    """An aio server with one service plus health and reflection; `port` is the bound one,
    `health_port` the plaintext health-only server's (None without one)."""

    server: grpc.aio.Server
    port: int
    service_name: str
    health: health.aio.HealthServicer
    security: ServerSecurity = field(default_factory=ServerSecurity)
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    @classmethod
    def build(
        cls,
        service_name: str,
        add_servicers: Callable[[grpc.aio.Server], None],
        host: str,
        port: int,
        *,
        health_servicer: health.aio.HealthServicer | None = None,
        extra_service_names: Sequence[str] = (),
        security: ServerSecurity | None = None,
        health_port: int | None = None,
        keepalive: Keepalive = KEEPALIVE,
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
    ) -> GrpcServer:
        """Unstarted; port 0 picks a free one. `add_servicers` registers the service's own
        servicers on the server; `security` (TLS, API keys) applies to every method but
        standard health, which a `health_port` also serves in plaintext."""
        security = security or ServerSecurity()
        health_servicer = health_servicer or health.aio.HealthServicer()
        interceptors: list = [GuardInterceptor(security.api_keys, client_roles=security.client_roles)]
        # NOTE: the OpenTelemetry interceptor only when tracing is set up (it costs an extra
        # async-generator hop per streamed message).
        if tracing_enabled():
            interceptors += grpc_server_interceptors()
        # NOTE: SO_REUSEPORT off (gRPC turns it on): a second process binding a live server's port
        # fails instead of sharing it, so a worker restarted on its port, or a scheduler named by
        # the port it serves on (its workers' leases), is alone there.
        options = (*keepalive.server_options(max_receive_bytes), ("grpc.so_reuseport", 0))
        server = grpc.aio.server(options=options, interceptors=interceptors)
        add_servicers(server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        enable_reflection((service_name, *extra_service_names, health.SERVICE_NAME), server)
        bound = _bind(server, host, port, security)
        built = cls(server, bound, service_name, health_servicer, security)
        if health_port is not None:
            built.health_server, built.health_port = _health_only_server(health_servicer, host, health_port, keepalive)
        return built

    @property
    def secure(self) -> bool:
        return self.security.tls is not None

    async def start(self, *, ready: bool) -> None:
        """Liveness SERVING at once; readiness as given (set it later with `set_ready`)."""
        await self.health.set("", SERVING)
        await self.set_ready(ready)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_ready(self, ready: bool) -> None:
        await self.health.set(self.service_name, SERVING if ready else NOT_SERVING)

    def set_ready_soon(self, ready: bool) -> None:
        """`set_ready` from synchronous code running on the server's event loop."""
        asyncio.get_running_loop().create_task(self.set_ready(ready))

    async def set_dead(self) -> None:
        """Liveness fails too: only a restart helps (an orchestrator then restarts the process)."""
        await self.health.set("", NOT_SERVING)
        await self.set_ready(False)

    async def stop(self, grace_s: float = 5.0, drain_s: float = 0.5) -> None:
        """Health first (balancers stop sending), a moment to notice, then in-flight calls get grace_s."""
        await self.health.enter_graceful_shutdown()
        await asyncio.sleep(drain_s)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)


def _bind(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity) -> int:
    address = f"{host}:{port}"
    if security.tls is not None:
        bound = server.add_secure_port(address, security.tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    return bound


def _health_only_server(
    servicer: health.aio.HealthServicer, host: str, port: int, keepalive: Keepalive
) -> tuple[grpc.aio.Server, int]:
    """Standard health alone, plaintext: what a Kubernetes `grpc:` probe can reach under mTLS.
    It shares the servicer, so its statuses are the main server's."""
    server = grpc.aio.server(options=keepalive.server_options(), interceptors=[GuardInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, _bind(server, host, port, ServerSecurity())
