"""The Generation API as a client in another language meets it: Node.js with @grpc/grpc-js,
@grpc/proto-loader, grpc-health-check and grpc-js-reflection-client (tests/node/client_check.js)
against an in-process scheduler with an API key. The npm packages are installed by this test
into a cache folder ($SLUICE_NODE_CACHE, else ~/.cache/sluice/node-client), never into the
repository; the test is skipped only where node or npm is missing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sluice.common.security import SecurityConfig, ServerSecurity
from sluice_bench.fault_harness import EchoWorker, stack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "node"
KEY = "node-key"


def node_cache() -> Path:
    """One folder per package.json (its hash), so a changed pin installs afresh."""
    digest = hashlib.sha256((NODE_DIR / "package.json").read_bytes()).hexdigest()[:12]
    base = os.environ.get("SLUICE_NODE_CACHE") or Path.home() / ".cache" / "sluice" / "node-client"
    return Path(base) / digest


def install(cache: Path) -> Path:
    modules = cache / "node_modules"
    if (modules / ".sluice-installed").exists():
        return modules
    cache.mkdir(parents=True, exist_ok=True)
    shutil.copy(NODE_DIR / "package.json", cache / "package.json")
    done = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
        cwd=cache,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"npm install failed in {cache}:\n{done.stderr[-2000:]}"
    (modules / ".sluice-installed").touch()
    return modules


@pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")), reason="needs node and npm on PATH")
async def test_a_node_client_loads_the_protos_streams_cancels_aborts_and_reflects() -> None:
    modules = await asyncio.to_thread(install, node_cache())
    worker = await EchoWorker.start(0, step_time_s=0.005)
    try:
        security = ServerSecurity.from_config(SecurityConfig(api_key=KEY))
        async with stack([worker.address], security=security) as s:
            proc = await asyncio.create_subprocess_exec(
                "node",
                str(NODE_DIR / "client_check.js"),
                f"127.0.0.1:{s.server.port}",
                KEY,
                str(ROOT / "protos"),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "NODE_PATH": str(modules)},
            )
            out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    finally:
        await worker.stop()
    assert out, f"node printed nothing: {err.decode()[-2000:]}"
    checks = json.loads(out.decode().strip().splitlines()[-1])
    assert "crashed" not in checks, checks.get("crashed")
    expected = [
        "protos_load",
        "stream",
        "x_request_id_in_initial_metadata",
        "cancel",
        "abort_by_metadata_id",
        "health",
        "reflection_v1",
        "reflection_v1alpha",
        "unauthenticated",
        "invalid_argument_with_bad_request",
    ]
    assert {name: checks.get(name) for name in expected} == dict.fromkeys(expected, True)
