"""The committed gRPC code matches the protos, and the protos pass buf lint."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from sluice.common.paths import repo_root


def test_committed_generated_code_matches_the_protos() -> None:
    result = subprocess.run(
        [sys.executable, "tools/gen_protos.py", "--check"], cwd=repo_root(), capture_output=True, text=True
    )
    assert result.returncode == 0, f"run `make protos`:\n{result.stdout}{result.stderr}"


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed (pip install buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=repo_root() / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_import_each_other_absolutely() -> None:
    from sluice.v1 import generation_pb2, worker_pb2

    request = generation_pb2.GenerateRequest(request_id="r", text="hi")
    assert request.WhichOneof("prompt") == "text"
    assert worker_pb2.ExecuteRequest(step_id=3).step_id == 3
