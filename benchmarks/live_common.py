"""Helpers of the live benchmarks: worker processes started and stopped as `sluice worker` is.

spawn_service(args, log_path) -> (process, port): any `sluice` command as a process, its port
    read from its "listening on" line
spawn_worker(engine="echo" | "torch", ...) -> WorkerProcess (`sluice worker` through spawn_service)
WorkerProcess.stop(): SIGTERM (graceful shutdown), then SIGKILL after a grace period
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"listening on ([\w.\-]+):(\d+)")


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    address: str
    log_path: Path

    def stop(self, grace_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spawn_worker(
    *,
    engine: str = "echo",
    model: str = "tiny-llama",
    worker_id: int = 0,
    threads: int = 1,
    extra: tuple[str, ...] = (),
    log_dir: Path | None = None,
    timeout_s: float = 120.0,
) -> WorkerProcess:
    """Starts one worker process on a free port and waits for its "listening on" line."""
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_path = log_dir / f"sluice-bench-worker-{os.getpid()}-{worker_id}.log"
    args = [
        "worker",
        "--engine",
        engine,
        "--model",
        model,
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--worker-id",
        str(worker_id),
        "--threads",
        str(threads),
        *extra,
    ]
    env = {"OMP_NUM_THREADS": str(threads)}
    process, port = spawn_service(args, log_path, timeout_s, env)
    return WorkerProcess(process, f"127.0.0.1:{port}", log_path)


def spawn_service(
    args: list[str], log_path: Path, timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    """`python -m services.cli ARGS` as a process (stderr to `log_path`, `env` over ours); its
    port from the "listening on" line of its stdout."""
    cmd = [sys.executable, "-m", "services.cli", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    log = log_path.open("w")
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=full_env)
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    for line in process.stdout:
        match = _LISTENING.search(line)
        if match:
            return process, int(match.group(2))
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"{args[0]} did not start ({' '.join(cmd)}); see {log_path}")
