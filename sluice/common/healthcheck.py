"""A gRPC health probe that needs no extra binary: the health check of every container image.

    python -m sluice.common.healthcheck --target 127.0.0.1:50061 --service sluice.v1.WorkerService
    python -m sluice.common.healthcheck --service sluice.v1.WorkerService   # target 127.0.0.1:$SLUICE_PORT
        -> grpc.health.v1.Health/Check(service) on a plaintext channel, within --timeout seconds
        -> exit 0: SERVING   1: any other status (NOT_SERVING, or a service it does not know)
           2: no answer (refused, deadline exceeded, ...)

Without `--target` it probes 127.0.0.1 on $SLUICE_PORT, the variable that gives the service
in the same container its `--port`, so an image's HEALTHCHECK needs no shell to expand it.
`--service ""` (the default) asks for liveness; a service name asks for that service's
readiness (`GrpcServer` sets it SERVING only while the service can serve). One line goes to
stdout or stderr saying what was seen, so `docker inspect` shows why a container is unhealthy.
Kubernetes needs none of this: its native `grpc:` probes call the same Health service.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_NO_ANSWER = 2
PORT_ENV = "SLUICE_PORT"


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """(exit code, one line saying what was seen) for one Health/Check call."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.NOT_FOUND:  # the server answers: it has no such service
                return EXIT_NOT_SERVING, f"{target} {service}: SERVICE_UNKNOWN (not registered with health)"
            return EXIT_NO_ANSWER, f"{target} {service or '(liveness)'}: no answer ({code.name}: {_details(exc)})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    code = EXIT_SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING
    return code, f"{target} {service or '(liveness)'}: {status}"


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if isinstance(exc, grpc.Call) else str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.common.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of the gRPC server (default 127.0.0.1:$SLUICE_PORT)")
    parser.add_argument("--service", default="", help='service name for readiness; "" (default) for liveness')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    args = parser.parse_args(argv)
    port = os.environ.get(PORT_ENV)
    if args.target is None and not port:
        parser.error(f"give --target HOST:PORT or set {PORT_ENV}")
    code, line = check(args.target or f"127.0.0.1:{port}", args.service, args.timeout)
    print(line, file=sys.stdout if code == EXIT_SERVING else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
