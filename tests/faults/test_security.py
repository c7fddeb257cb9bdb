"""Authentication and encryption: API keys on the Generation API (health needs none), TLS and
mutual TLS from files made in the test (and by `sluice certs`), the plaintext health port for
probes under mTLS, mTLS between the scheduler and its workers, Abort only by the request's
owner, and a request that does not parse answered INVALID_ARGUMENT with no traceback logged."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import main as sluice
from services.serve import SchedulerServiceConfig, ServeConfig, worker_command, worker_environment
from services.worker import WorkerConfig
from sluice.common.certs import write_dev_pki
from sluice.common.client import SluiceClient
from sluice.common.config import config_from
from sluice.common.security import ClientSecurity, SecurityConfig, ServerSecurity, redacted
from sluice.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluice_bench.fault_harness import EchoWorker, prompt, sampling, spawn_worker_process, stack
from worker_service.server import WorkerServerOptions

ROOT = Path(__file__).resolve().parents[2]

KEYS = "key-alice,key-bob"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    assert sluice(["certs", "--out", str(folder), "--name", "scheduler", "--name", "worker", "--name", "alice"]) == 0
    write_dev_pki(folder / "other", ["mallory"])  # signed by a CA nobody trusts
    write_dev_pki(folder / "bob", ["bob"])
    return folder


def files(folder: Path, name: str, ca: Path | None = None, *, cert: bool = True) -> SecurityConfig:
    return SecurityConfig(
        tls_cert=str(folder / f"{name}.crt") if cert else None,
        tls_key=str(folder / f"{name}.key") if cert else None,
        tls_ca=str(ca or folder / "ca.crt"),
    )


async def test_api_keys_guard_every_method_but_health_and_name_what_is_wrong() -> None:
    worker = await EchoWorker.start(0)
    try:
        security = ServerSecurity.from_config(SecurityConfig(api_key=KEYS))
        async with stack([worker.address], security=security) as s:
            stub = generation_pb2_grpc.GenerationServiceStub(s.channel)
            missing = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.GetStats(generation_pb2.GetStatsRequest(), metadata=(("authorization", "Bearer nope"),))
            health = await health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(service=""))
            s.metadata = (("authorization", "Bearer key-bob"),)
            served = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
            async with SluiceClient(f"127.0.0.1:{s.server.port}", security=ClientSecurity(api_key="key-alice")) as c:
                completion = await c.complete([5, 6, 7], max_tokens=3, ignore_eos=True)
        assert missing.code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in missing.details
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED and wrong.value.details() == "invalid API key"
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert served.ok and len(served.tokens) == 4
        assert len(completion.token_ids) == 3, "the Python client sends its key"
    finally:
        await worker.stop()


async def test_abort_is_only_for_the_request_owner() -> None:
    worker = await EchoWorker.start(0, step_time_s=0.01)
    try:
        security = ServerSecurity.from_config(SecurityConfig(api_key=KEYS))
        async with stack([worker.address], security=security) as s:
            alice, bob = (("authorization", "Bearer key-alice"),), (("authorization", "Bearer key-bob"),)
            s.metadata = alice
            call = s.stub.Generate(
                generation_pb2.GenerateRequest(request_id="mine", token_ids=prompt(0), sampling_params=sampling(500)),
                metadata=alice,
            )
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await s.stub.Abort(generation_pb2.AbortRequest(request_ids=["mine", "unknown"]), metadata=bob)
            assert "mine" in s.live.streams, "nothing was aborted"
            ok = await s.stub.Abort(generation_pb2.AbortRequest(request_ids=["mine"]), metadata=alice)
            ending = await s.collect(call)
            assert await s.wait_idle() == 0
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'mine'" in denied.value.details()
        assert list(ok.aborted_ids) == ["mine"]
        assert ending.ok and ending.finish_reason == 3  # FINISH_REASON_ABORT
    finally:
        await worker.stop()


async def test_mutual_tls_everywhere_with_plaintext_health_for_probes(pki: Path) -> None:
    worker_tls = ServerSecurity.from_config(files(pki, "worker"))
    worker = await EchoWorker.start(0, options=WorkerServerOptions(security=worker_tls, health_port=0))
    try:
        # The scheduler dials the worker with its own certificate (mutual TLS both ways).
        async with stack(
            [f"localhost:{worker.server.port}"],
            security=ServerSecurity.from_config(files(pki, "scheduler")),
            client=ClientSecurity.from_config(files(pki, "alice")),
            worker_client=ClientSecurity.from_config(files(pki, "scheduler")),
        ) as s:
            served = await s.generate(token_ids=prompt(0), sampling_params=sampling(5))
            port = s.server.port
            no_cert = ClientSecurity.from_config(files(pki, "alice", cert=False))
            async with no_cert.channel(f"localhost:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as without:
                    await generation_pb2_grpc.GenerationServiceStub(channel).GetStats(
                        generation_pb2.GetStatsRequest(), timeout=5
                    )
            untrusted = ClientSecurity.from_config(files(pki / "other", "mallory", pki / "ca.crt"))
            async with untrusted.channel(f"localhost:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as foreign:
                    await generation_pb2_grpc.GenerationServiceStub(channel).GetStats(
                        generation_pb2.GetStatsRequest(), timeout=5
                    )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.health_port}") as plain:
            probe = await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service="sluice.v1.WorkerService")
            )
            with pytest.raises(grpc.aio.AioRpcError) as only_health:
                await plain.unary_unary("/sluice.v1.WorkerService/Info")(b"", timeout=5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert served.ok and len(served.tokens) == 5
        assert without.value.code() == grpc.StatusCode.UNAVAILABLE, "no client certificate: no handshake"
        assert foreign.value.code() == grpc.StatusCode.UNAVAILABLE, "a certificate our CA did not sign"
        assert probe.status == health_pb2.HealthCheckResponse.SERVING, "the worker's own readiness (warmed up)"
        assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE, "the TLS port speaks no plaintext"
    finally:
        await worker.stop()


async def test_under_mtls_abort_ownership_follows_the_client_certificate(pki: Path) -> None:
    worker = await EchoWorker.start(0, step_time_s=0.01)
    bob_ca = pki / "bob" / "ca.crt"
    try:
        ca_bundle = pki / "bundle.crt"
        ca_bundle.write_bytes((pki / "ca.crt").read_bytes() + bob_ca.read_bytes())
        server = ServerSecurity.from_config(files(pki, "scheduler", ca_bundle))
        alice = ClientSecurity.from_config(files(pki, "alice"))
        bob = ClientSecurity.from_config(files(pki / "bob", "bob", pki / "ca.crt"))
        async with stack([worker.address], security=server, client=alice) as s:
            call = s.stub.Generate(
                generation_pb2.GenerateRequest(request_id="a1", token_ids=prompt(0), sampling_params=sampling(500))
            )
            await call.read()
            async with bob.channel(f"localhost:{s.server.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await generation_pb2_grpc.GenerationServiceStub(channel).Abort(
                        generation_pb2.AbortRequest(request_ids=["a1"])
                    )
            ok = await s.stub.Abort(generation_pb2.AbortRequest(request_ids=["a1"]))
            await s.collect(call)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert list(ok.aborted_ids) == ["a1"]
    finally:
        await worker.stop()


def test_the_settings_the_deploy_manifests_name_and_loopback_by_default() -> None:
    env = {"SLUICE_API_KEY": "k", "SLUICE_TLS_CERT": "c.pem", "SLUICE_TLS_KEY": "k.pem", "SLUICE_TLS_CA": "ca.pem"}
    env["SLUICE_HEALTH_PORT"] = "8081"
    for cls in (SchedulerServiceConfig, WorkerConfig):
        cfg = config_from(cls, environ=env)
        assert (cfg.api_key, cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.health_port) == (
            "k",
            "c.pem",
            "k.pem",
            "ca.pem",
            8081,
        )
        assert cls().host == "127.0.0.1"
    exposed = ServeConfig(host="0.0.0.0", api_key="secret")
    command = worker_command(exposed, 0)
    assert command[command.index("--host") + 1] == "127.0.0.1", "serve's workers stay on loopback"
    assert "secret" not in " ".join(command), "the key travels in the environment, not on the command line"
    assert worker_environment(exposed)["SLUICE_API_KEY"] == "secret"
    assert redacted({"api_key": "secret", "worker_api_key": None, "port": 1}) == {
        "api_key": "<set>",
        "worker_api_key": None,
        "port": 1,
    }


def test_settings_that_cannot_work_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerSecurity.from_config(SecurityConfig(tls_cert="x.crt"))
    with pytest.raises(ValueError, match="tls_cert: cannot read"):
        ServerSecurity.from_config(SecurityConfig(tls_cert=str(tmp_path / "no.crt"), tls_key=str(tmp_path / "no.key")))
    (tmp_path / "ca.crt").write_text("a CA bundle")
    with pytest.raises(ValueError, match="without tls_cert"):
        ServerSecurity.from_config(SecurityConfig(tls_ca=str(tmp_path / "ca.crt")))


async def test_a_request_that_does_not_parse_is_invalid_argument_and_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address]) as s:
            raw_generate = s.channel.unary_stream("/sluice.v1.GenerationService/Generate")
            raw_stats = s.channel.unary_unary("/sluice.v1.GenerationService/GetStats")
            raw_execute = grpc.aio.insecure_channel(worker.address).stream_stream("/sluice.v1.WorkerService/Execute")
            with caplog.at_level(logging.DEBUG):
                errors = []
                for call in (raw_generate(b"\x12\xff\xff\xff"), raw_stats(b"\xff")):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await (call.read() if hasattr(call, "read") else call)
                    errors.append(info.value)
                stream = raw_execute(metadata=(("x-sluice-session", s.live.loops[0].remote.session),))
                await stream.write(b"\x0a\x80")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stream.read()
                errors.append(info.value)
                served = await s.generate(token_ids=prompt(0), sampling_params=sampling(3))
            await asyncio.sleep(0)
        assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
        assert "sluice.v1.GenerateRequest" in errors[0].details()
        assert "sluice.v1.ExecuteRequest" in errors[2].details()
        assert not [r for r in caplog.records if r.exc_info], "no traceback logged"
        assert served.ok, "the service carries on"
    finally:
        await worker.stop()


async def test_a_refused_client_certificate_is_explained_on_both_sides(
    pki: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """gRPC tells the client only "Socket closed": the client names the likely cause (no client
    certificate under mutual TLS) and the server's log says which side refused and why."""
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address], security=ServerSecurity.from_config(files(pki, "scheduler"))) as s:
            cmd = [sys.executable, "-m", "services.cli", "generate", "--target", f"localhost:{s.server.port}"]
            cmd += ["--tls-ca", str(pki / "ca.crt"), "--timeout", "5", "hello"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
            done = await asyncio.to_thread(
                subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
            )
    finally:
        await worker.stop()
    server_log = capfd.readouterr().err
    assert done.returncode == 2
    assert "UNAVAILABLE" in done.stderr and "requires a client certificate" in done.stderr
    assert "Handshake failed" in server_log and "PEER_DID_NOT_RETURN_A_CERTIFICATE" in server_log


async def test_a_worker_under_serve_accepts_only_its_schedulers_certificate_role(pki: Path) -> None:
    """`sluice serve` hands its workers the role of its own certificate (`sluice certs` writes
    it as the subject OU): a client's certificate, signed by the same CA, is refused."""
    cfg = ServeConfig(
        tls_cert=str(pki / "scheduler.crt"), tls_key=str(pki / "scheduler.key"), tls_ca=str(pki / "ca.crt")
    )
    env = worker_environment(cfg)
    assert env["SLUICE_TLS_CLIENT_ROLES"] == "scheduler"
    tls = ["--tls-cert", str(pki / "worker.crt"), "--tls-key", str(pki / "worker.key"), "--tls-ca", str(pki / "ca.crt")]
    worker = await spawn_worker_process(0, extra=tls, env={"SLUICE_TLS_CLIENT_ROLES": env["SLUICE_TLS_CLIENT_ROLES"]})
    try:
        answers = {}
        for name in ("scheduler", "alice"):
            async with ClientSecurity.from_config(files(pki, name)).channel(f"localhost:{worker.port}") as channel:
                try:
                    await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
                    answers[name] = "OK"
                except grpc.aio.AioRpcError as exc:
                    answers[name] = f"{exc.code().name}: {exc.details()}"
    finally:
        worker.stop()
    assert answers["scheduler"] == "OK"
    assert answers["alice"] == (
        "PERMISSION_DENIED: client certificate role 'client' may not call this service (tls_client_roles: scheduler)"
    )
