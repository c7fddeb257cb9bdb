"""The container health probe over real gRPC: exit 0 only while the asked service is SERVING."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from sluice.common.grpc_server import GrpcServer
from sluice.common.healthcheck import EXIT_NO_ANSWER, EXIT_NOT_SERVING, EXIT_SERVING, check

SERVICE = "sluice.v1.WorkerService"


async def _probe(target: str, service: str) -> tuple[int, str]:
    # NOTE: the probe is blocking gRPC; the server under test runs on this loop, so off it.
    return await asyncio.to_thread(check, target, service, 2.0)


@pytest.fixture
async def server():
    srv = GrpcServer.build(SERVICE, lambda _: None, "127.0.0.1", 0)
    await srv.start(ready=False)
    yield srv
    await srv.server.stop(0)


async def test_liveness_serves_while_readiness_waits_for_the_service(server: GrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"
    assert await _probe(target, "") == (EXIT_SERVING, f"{target} (liveness): SERVING")
    assert await _probe(target, SERVICE) == (EXIT_NOT_SERVING, f"{target} {SERVICE}: NOT_SERVING")
    await server.set_ready(True)
    assert (await _probe(target, SERVICE))[0] == EXIT_SERVING


async def test_an_unknown_service_and_a_dead_engine_are_not_serving(server: GrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"
    code, line = await _probe(target, "sluice.v1.NoSuchService")
    assert code == EXIT_NOT_SERVING and "SERVICE_UNKNOWN" in line
    await server.set_ready(True)
    await server.set_dead()
    assert (await _probe(target, ""))[0] == EXIT_NOT_SERVING
    assert (await _probe(target, SERVICE))[0] == EXIT_NOT_SERVING


async def test_graceful_shutdown_fails_the_probe_before_the_port_closes(server: GrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"
    await server.set_ready(True)
    await server.health.enter_graceful_shutdown()
    assert (await _probe(target, SERVICE))[0] == EXIT_NOT_SERVING


async def test_nothing_listening_is_no_answer_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, line = await asyncio.to_thread(check, f"127.0.0.1:{port}", SERVICE, 1.0)
    assert code == EXIT_NO_ANSWER and "UNAVAILABLE" in line


async def test_the_module_command_exits_with_the_status(server: GrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"

    async def run(service: str) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sluice.common.healthcheck", "--target", target, "--service", service,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out, err

    code, _, err = await run(SERVICE)
    assert code == EXIT_NOT_SERVING and b"NOT_SERVING" in err
    await server.set_ready(True)
    code, out, _ = await run(SERVICE)
    assert code == EXIT_SERVING and out.strip() == f"{target} {SERVICE}: SERVING".encode()


async def test_without_a_target_the_probe_asks_the_port_in_sluice_port(server: GrpcServer) -> None:
    await server.set_ready(True)
    env = {**os.environ, "SLUICE_PORT": str(server.port)}
    cmd = (sys.executable, "-m", "sluice.common.healthcheck", "--service", SERVICE)
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == EXIT_SERVING and out.startswith(f"127.0.0.1:{server.port} ".encode())
    env.pop("SLUICE_PORT")
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"SLUICE_PORT" in err  # argparse's usage error
