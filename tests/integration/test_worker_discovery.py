"""Worker discovery over real gRPC: the scheduler (started as `sluice scheduler --workers-dns`
starts it) finds its workers by resolving a name, and workers join and leave the running
cluster while clients stream.

The workers are echo workers (the real worker server, plans checked exactly, no model) on
loopback addresses 127.0.0.2, 127.0.0.3, ... all on ONE port, as a headless Service's pods
are; the name is resolved by a hosts-table resolver the test edits, in place of the system's.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import grpc
import pytest

from scheduler_service.live.discovery import DnsTarget, WorkerDiscovery, resolve_host
from services.serve import SchedulerServiceConfig, start_scheduler
from sluice.common.certs import write_dev_pki
from sluice.common.grpc_server import GrpcServer
from sluice.common.security import PLAINTEXT, ClientSecurity, SecurityConfig, ServerSecurity
from sluice.v1 import generation_pb2
from sluice_bench.fault_harness import Ending, Stack, prompt, sampling, spawn_worker_process
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import WorkerServerOptions, build_server

NAME = "workers.sluice.test"
IPS = [f"127.0.0.{i}" for i in range(2, 8)]
MAX_TOKENS = 24


class HostsTable:
    """A name service the test controls: NAME -> IPs, like the lines of a hosts file."""

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self.failing = False

    async def resolve(self, host: str) -> list[str]:
        if self.failing or host not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: name or service not known")
        return list(self.names[host])


def free_port_on_all(ips: list[str]) -> int:
    for _ in range(50):
        with socket.socket() as first:
            first.bind((ips[0], 0))
            port = first.getsockname()[1]
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


async def echo_worker(
    ip: str, port: int, worker_id: int, model: str = "tiny-llama", security: ServerSecurity | None = None
) -> GrpcServer:
    engine = EchoEngine(EngineConfig(model=model), step_time_s=0.003)
    options = WorkerServerOptions(security=security) if security is not None else None
    server = build_server(engine, port, host=ip, worker_id=worker_id, options=options)
    await server.start(ready=False)
    return server


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate(), "timed out"


def scheduler_config(port: int, **extra: object) -> SchedulerServiceConfig:
    return SchedulerServiceConfig(
        port=0,
        workers_dns=[f"{NAME}:{port}"],
        workers_dns_refresh_s=0.05,
        workers_dns_drop_after=1,
        num_gpu_blocks=256,
        swap_space_gib=0.001,
        max_waiting=1000,
        reconnect_max_s=0.5,
        **extra,  # type: ignore[arg-type]
    )


async def with_stack(
    cfg: SchedulerServiceConfig,
    hosts: HostsTable,
    body: Callable[[Stack], Awaitable[None]],
    client: ClientSecurity = PLAINTEXT,
) -> None:
    server = await start_scheduler(cfg, [], resolver=hosts.resolve)
    try:
        async with client.channel(f"127.0.0.1:{server.port}") as channel:
            await body(Stack(server, channel))
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)


def discovery_of(s: Stack) -> WorkerDiscovery:
    assert s.live.discovery is not None
    return s.live.discovery


async def test_workers_join_and_leave_by_dns_under_load_and_no_request_is_lost() -> None:
    port = free_port_on_all(IPS)
    hosts = HostsTable()
    workers = {ip: await echo_worker(ip, port, i) for i, ip in enumerate(IPS[:2])}
    hosts.names[NAME] = IPS[:2]

    async def body(s: Stack) -> None:
        live = s.live
        assert sorted(live.worker_addresses()) == [f"{ip}:{port}" for ip in IPS[:2]]
        discovery = discovery_of(s)
        reference = await s.generate(request_id="reference", token_ids=prompt(0), sampling_params=sampling(MAX_TOKENS))
        assert reference.ok and len(reference.tokens) == MAX_TOKENS
        calls: list[asyncio.Future[Ending]] = []
        stop_load = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop_load.is_set():
                call = s.generate(request_id=f"r{i}", token_ids=prompt(i), sampling_params=sampling(MAX_TOKENS))
                calls.append(asyncio.ensure_future(call))
                i += 1
                await asyncio.sleep(0.01)

        loader = asyncio.ensure_future(load())
        try:
            await wait_for(lambda: len(calls) >= 10)
            # scale up: a third worker appears under the name and serves
            workers[IPS[2]] = await echo_worker(IPS[2], port, 2)
            hosts.names[NAME] = IPS[:3]
            await wait_for(lambda: f"{IPS[2]}:{port}" in live.worker_addresses())
            new_id = live.worker_addresses()[f"{IPS[2]}:{port}"]
            await wait_for(lambda: live.loops[new_id].num_steps >= 3)

            # scale down, the worker still running: it leaves between two steps, holding requests
            first = live.worker_addresses()[f"{IPS[0]}:{port}"]
            await wait_for(lambda: len(live.cluster.schedulers[first].running) >= 3)
            hosts.names[NAME] = IPS[1:3]
            await wait_for(lambda: discovery.num_removed == 1)
            assert f"{IPS[0]}:{port}" not in live.worker_addresses()
            assert discovery.num_requeued >= 1, "the removed worker held requests, re-queued on the others"
            assert first not in live.cluster.schedulers and first not in live.cluster.kv.workers
            await workers.pop(IPS[0]).server.stop(None)

            # scale down as a pod terminates: the worker dies first, then leaves the name
            second = live.worker_addresses()[f"{IPS[1]}:{port}"]
            await wait_for(lambda: len(live.cluster.schedulers[second].running) >= 1)
            await workers.pop(IPS[1]).server.stop(None)
            await wait_for(lambda: not live.cluster.healthy.get(second, False))
            hosts.names[NAME] = IPS[2:3]
            await wait_for(lambda: discovery.num_removed == 2)
            assert f"{IPS[1]}:{port}" not in live.worker_addresses()

            # and up again
            workers[IPS[3]] = await echo_worker(IPS[3], port, 3)
            hosts.names[NAME] = [IPS[2], IPS[3]]
            await wait_for(lambda: f"{IPS[3]}:{port}" in live.worker_addresses())
            await asyncio.sleep(0.2)
        finally:
            stop_load.set()
            await loader
        endings = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
        assert len(endings) >= 20
        failed = [(e.request_id, e.code.name, e.details) for e in endings if not e.ok]
        assert not failed, f"requests failed while workers came and went: {failed[:5]}"
        # the echo worker's tokens depend only on the position: a request recomputed after its
        # worker left streams exactly the tokens it would have, none twice, none missing
        wrong = [e.request_id for e in endings if e.tokens != reference.tokens]
        assert not wrong, f"streams differ from an undisturbed one: {wrong[:5]}"
        assert await s.wait_idle() == 0
        for sched in live.cluster.schedulers.values():
            sched.assert_empty()
        info = await s.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
        assert sorted(w.address for w in info.workers) == [f"{IPS[2]}:{port}", f"{IPS[3]}:{port}"]
        assert discovery.num_added == 2 and discovery.num_removed == 2

    try:
        await with_stack(scheduler_config(port), hosts, body)
    finally:
        for server in workers.values():
            await server.server.stop(None)


async def test_the_last_worker_leaving_ends_its_requests_unavailable_never_ok() -> None:
    port = free_port_on_all(IPS[:2])
    hosts = HostsTable()
    workers = {IPS[0]: await echo_worker(IPS[0], port, 0)}
    hosts.names[NAME] = IPS[:1]

    async def body(s: Stack) -> None:
        live = s.live
        calls = [
            asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(200))) for i in range(8)
        ]
        await wait_for(lambda: sum(len(sc.running) for sc in live.cluster.schedulers.values()) >= 4)
        hosts.names[NAME] = []
        endings = await asyncio.wait_for(asyncio.gather(*calls), timeout=60)
        assert {e.code for e in endings} == {grpc.StatusCode.UNAVAILABLE}, [e.code for e in endings]
        assert not live.worker_addresses() and not live.is_healthy
        refused = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        # a worker appearing under the name serves again, without a restart
        workers[IPS[1]] = await echo_worker(IPS[1], port, 1)
        hosts.names[NAME] = IPS[1:2]
        await wait_for(lambda: live.is_healthy)
        again = await s.generate(token_ids=prompt(1), sampling_params=sampling(8))
        assert again.ok and len(again.tokens) == 8

    try:
        await with_stack(scheduler_config(port), hosts, body)
    finally:
        for server in workers.values():
            await server.server.stop(None)


async def test_a_failed_resolution_changes_nothing_and_another_model_is_refused() -> None:
    port = free_port_on_all(IPS[:2])
    hosts = HostsTable()
    workers = {IPS[0]: await echo_worker(IPS[0], port, 0)}
    hosts.names[NAME] = IPS[:1]

    async def body(s: Stack) -> None:
        live = s.live
        discovery = discovery_of(s)
        hosts.failing = True  # a DNS outage must not empty the cluster
        await asyncio.sleep(0.3)
        assert list(live.worker_addresses()) == [f"{IPS[0]}:{port}"] and live.is_healthy
        hosts.failing = False
        workers[IPS[1]] = await echo_worker(IPS[1], port, 1, model="tiny-opt")
        hosts.names[NAME] = IPS[:2]
        await wait_for(lambda: f"{IPS[1]}:{port}" in discovery.refused)
        assert list(live.worker_addresses()) == [f"{IPS[0]}:{port}"]
        ok = await s.generate(token_ids=prompt(2), sampling_params=sampling(8))
        assert ok.ok and len(ok.tokens) == 8

    try:
        await with_stack(scheduler_config(port), hosts, body)
    finally:
        for server in workers.values():
            await server.server.stop(None)


async def test_under_tls_a_discovered_worker_is_verified_against_the_name_not_its_ip(tmp_path) -> None:
    # the workers' certificate names the Service (and loopback 127.0.0.1), not 127.0.0.2/.3
    write_dev_pki(tmp_path, ["scheduler", "worker"], hosts=[NAME])
    tls = {name: SecurityConfig(
        tls_cert=str(tmp_path / f"{name}.crt"), tls_key=str(tmp_path / f"{name}.key"), tls_ca=str(tmp_path / "ca.crt")
    ) for name in ("scheduler", "worker")}  # fmt: skip
    port = free_port_on_all(IPS[:2])
    hosts = HostsTable()
    security = ServerSecurity.from_config(tls["worker"])
    workers = {IPS[0]: await echo_worker(IPS[0], port, 0, security=security)}
    hosts.names[NAME] = IPS[:1]

    async def body(s: Stack) -> None:
        workers[IPS[1]] = await echo_worker(IPS[1], port, 1, security=security)
        hosts.names[NAME] = IPS[:2]
        await wait_for(lambda: len(s.live.worker_addresses()) == 2)
        calls = [s.generate(token_ids=prompt(i), sampling_params=sampling(6)) for i in range(4)]
        endings = await asyncio.gather(*calls)
        assert all(e.ok and len(e.tokens) == 6 for e in endings)
        assert all(loop.num_steps > 0 for loop in s.live.loops.values()), "both workers served over TLS"

    cfg = scheduler_config(port, tls_cert=tls["scheduler"].tls_cert, tls_key=tls["scheduler"].tls_key)
    cfg.tls_ca = tls["scheduler"].tls_ca
    try:
        await with_stack(cfg, hosts, body, client=ClientSecurity.from_config(tls["scheduler"]))
    finally:
        for server in workers.values():
            await server.server.stop(None)


async def test_a_resolved_worker_that_is_gone_at_start_is_left_to_discovery() -> None:
    port = free_port_on_all(IPS[:2])
    hosts = HostsTable()
    workers = {IPS[0]: await echo_worker(IPS[0], port, 0)}
    hosts.names[NAME] = IPS[:2]  # nothing listens at the second (yet)

    async def body(s: Stack) -> None:
        assert list(s.live.worker_addresses()) == [f"{IPS[0]}:{port}"]
        workers[IPS[1]] = await echo_worker(IPS[1], port, 1)
        await wait_for(lambda: len(s.live.worker_addresses()) == 2)
        calls = [s.generate(token_ids=prompt(i), sampling_params=sampling(6)) for i in range(4)]
        assert all(e.ok and len(e.tokens) == 6 for e in await asyncio.gather(*calls))

    try:
        await with_stack(scheduler_config(port, connect_timeout_s=2.0), hosts, body)
    finally:
        for server in workers.values():
            await server.server.stop(None)


async def test_a_worker_process_found_through_the_system_resolver_serves() -> None:
    """`sluice worker` on 127.0.0.1 and the scheduler told `--workers-dns localhost:PORT`: the
    system resolver may also answer ::1, where nothing listens; that address is left to
    discovery and the start goes on with the worker it had."""
    worker = await spawn_worker_process(0, step_ms=1.0)
    try:
        cfg = scheduler_config(worker.port, connect_timeout_s=3.0)
        cfg.workers_dns = [f"localhost:{worker.port}"]
        server = await start_scheduler(cfg, [])
        try:
            assert list(server.live.worker_addresses()) == [worker.address]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                ending = await Stack(server, channel).generate(token_ids=prompt(0), sampling_params=sampling(5))
            assert ending.ok and len(ending.tokens) == 5
        finally:
            await server.stop(grace_s=1.0, drain_s=0.0)
    finally:
        worker.stop()


async def test_the_system_resolver_answers_a_real_name() -> None:
    assert "127.0.0.1" in await resolve_host("localhost")
    found = await WorkerDiscovery([DnsTarget.parse("localhost:50061")]).resolve()
    assert found is not None and "127.0.0.1:50061" in found


@pytest.mark.parametrize("text", ["sluice-worker", "sluice-worker:", ":50061", "sluice-worker:http", "w:70000"])
def test_a_target_that_is_not_name_and_port_is_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match="workers_dns"):
        DnsTarget.parse(text)
