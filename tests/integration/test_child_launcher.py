"""services/child.py's start_listening, the one way a service is started as a child and its
address read (by `sluice serve`'s helpers, the live benchmarks and the fault harness): a real
`sluice worker` process, a child that exits first, and one that never listens."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from services.child import listening_address, start_listening
from sluice.v1 import worker_pb2, worker_pb2_grpc


def test_every_service_line_form_gives_its_address() -> None:
    assert listening_address("sluice worker listening on 127.0.0.1:50061 (engine echo)") == "127.0.0.1:50061"
    assert listening_address(b"sluice scheduler listening on [::1]:50051 (policy vllm)") == "[::1]:50051"
    assert listening_address("sluice gateway listening on localhost:8000") == "localhost:8000"
    assert listening_address("loading the model") is None


def test_a_worker_started_as_a_child_answers_at_the_address_it_printed() -> None:
    cmd = [sys.executable, "-m", "services.cli", "worker", "--engine", "echo", "--model", "tiny-llama"]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--threads", "1"]
    process, address = start_listening(cmd, timeout_s=120)
    try:
        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=30)
        assert info.model
    finally:
        process.kill()
        process.wait()


def test_a_child_that_exits_before_listening_is_named_with_its_code() -> None:
    with pytest.raises(RuntimeError, match="exited with code 3"):
        start_listening([sys.executable, "-c", "print('starting'); raise SystemExit(3)"])


def test_a_child_that_never_listens_is_ended_at_the_timeout() -> None:
    code = "import time; print('listening soon', flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError, match="no address within 1 s"):
        start_listening([sys.executable, "-c", code], timeout_s=1.0)


def test_a_command_that_cannot_run_is_reported_by_the_launcher() -> None:
    with pytest.raises(RuntimeError, match="cannot run"):
        start_listening(["/nonexistent/sluice-service"], stderr=subprocess.DEVNULL)
