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

    python -m sluice.common.healthcheck --http /health     # the HTTP gateway's image
        -> GET http://127.0.0.1:$SLUICE_PORT/health (https when SLUICE_TLS_CERT is set: the
           probe reaches its own container, so the certificate is not checked)
        -> exit 0: 200   1: another status (503: no worker ready)   2: no answer
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


def check_http(port: str, path: str, timeout_s: float = 3.0, tls: bool = False) -> tuple[int, str]:
    """(exit code, one line) for GET `path` on this container's HTTP port."""
    import ssl
    import urllib.error
    import urllib.request

    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}{path}"
    context = ssl._create_unverified_context() if tls else None  # our own container
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return EXIT_SERVING, f"{url}: {resp.status}"
    except urllib.error.HTTPError as exc:
        return EXIT_NOT_SERVING, f"{url}: {exc.code} {exc.read(200).decode(errors='replace')}"
    except OSError as exc:
        return EXIT_NO_ANSWER, f"{url}: no answer ({exc})"


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if isinstance(exc, grpc.Call) else str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.common.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="HOST:PORT of the gRPC server (default 127.0.0.1:$SLUICE_PORT)")
    parser.add_argument("--service", default="", help='service name for readiness; "" (default) for liveness')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    parser.add_argument("--http", metavar="PATH", help="probe GET PATH over HTTP on 127.0.0.1:$SLUICE_PORT instead")
    args = parser.parse_args(argv)
    port = os.environ.get(PORT_ENV)
    if args.http is not None:
        if not port:
            parser.error(f"--http needs {PORT_ENV}")
        code, line = check_http(port, args.http, args.timeout, tls=bool(os.environ.get("SLUICE_TLS_CERT")))
        print(line, file=sys.stdout if code == EXIT_SERVING else sys.stderr)
        return code
    if args.target is None and not port:
        parser.error(f"give --target HOST:PORT or set {PORT_ENV}")
    code, line = check(args.target or f"127.0.0.1:{port}", args.service, args.timeout)
    print(line, file=sys.stdout if code == EXIT_SERVING else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
