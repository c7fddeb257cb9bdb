"""A worker given helper CPUs (`sluice worker --helper-cpus`, which `sluice serve` sets to the
scheduler side's cores when it places the workers): once warmed up and on an Execute stream,
gRPC's threads and Python's helper threads run on those CPUs, while the threads steps run on (the
event loop's and the engine thread) and native threads named as the process (OpenMP's compute
threads) stay on the worker's own; steps are answered as before. Without helper CPUs nothing
moves."""

from __future__ import annotations

import _thread
import contextlib
import os
import threading
from collections.abc import Iterator

import grpc
import pytest
from harness import LeasedStub
from test_worker_engine_runner import plans, run_steps

from services.worker import WorkerConfig
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import EngineRunner, WorkerServerOptions, build_server

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux threads and 2 CPUs this process may use",
)


def _name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


@contextlib.contextmanager
def _native_thread() -> Iterator[int]:
    """A thread started outside `threading` (as OpenMP starts its compute threads): its native id."""
    started, release = _thread.allocate_lock(), _thread.allocate_lock()
    started.acquire()
    release.acquire()
    ids: list[int] = []

    def body() -> None:
        ids.append(threading.get_native_id())
        started.release()
        release.acquire()

    _thread.start_new_thread(body, ())
    started.acquire()
    try:
        yield ids[0]
    finally:
        release.release()


def _every_thread_to(cpus: set[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


@pytest.mark.parametrize("given", [True, False])
async def test_helper_threads_move_to_the_helper_cpus_and_step_threads_stay(given: bool) -> None:
    own = os.sched_getaffinity(0)
    helper = frozenset({min(own)})
    engine = EchoEngine(EngineConfig(model="tiny-llama"))
    runner = EngineRunner(engine)
    options = WorkerServerOptions(helper_cpus=helper if given else None)
    server = build_server(engine, 0, runner=runner, options=options)
    try:
        with _native_thread() as native:
            await server.start(ready=False)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=16))
                await run_steps(LeasedStub(stub, warm.session_id), plans(4))
            grpc_threads = [int(t) for t in os.listdir("/proc/self/task") if _name(int(t)) == "event_engine"]
            poller = [t.native_id for t in threading.enumerate() if "_poll_wrapper" in t.name]
            assert grpc_threads and poller, "gRPC runs threads of its own beside the loop"
            assert runner.step_threads, "Warmup ran on the engine thread"
            helpers_on = {os.sched_getaffinity(t) == helper for t in (*grpc_threads, *poller)}
            assert helpers_on == {given}
            for tid in (threading.get_native_id(), *runner.step_threads, native):
                assert os.sched_getaffinity(tid) == own, f"thread {tid} ({_name(tid)}) left its CPUs"
    finally:
        await server.server.stop(None)
        _every_thread_to(own)  # NOTE: gRPC's threads are this test process's, shared with later tests


def test_the_worker_flag_takes_cpus_the_worker_itself_is_not_pinned_to() -> None:
    from services.affinity import parse_cpus
    from services.worker import parse_args
    from sluice.common.config import config_from

    every = os.cpu_count() or 1
    cfg = config_from(WorkerConfig, parse_args(["--helper-cpus", f"0-{every - 1}"]))
    assert parse_cpus(cfg.helper_cpus, "helper_cpus", own=False) == set(range(every))
    with pytest.raises(ValueError, match=r"^helper_cpus: "):
        parse_cpus(str(every), "helper_cpus", own=False)
