"""Helpers of the live benchmarks: worker processes started and stopped as `sluice serve` starts
and stops them (its launcher, services/child.py: a child dies with the benchmark).

spawn_service(args, log_path) -> (process, port): any `sluice` command as a process, its port
    read from its "listening on" line
spawn_worker(engine="echo" | "torch", ...) -> WorkerProcess (`sluice worker` through spawn_service)
WorkerProcess.stop(): SIGTERM (graceful shutdown), then SIGKILL after a grace period
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from services.child import start_listening

ROOT = Path(__file__).resolve().parents[1]


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
    """`python -m services.cli ARGS` as a child process (services/child.py's launcher: it dies with
    this process), stderr to `log_path`, `env` over ours; its port from its "listening on" line."""
    cmd = [sys.executable, "-m", "services.cli", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("w") as log:
        try:
            process, address = start_listening(cmd, env=full_env, cwd=ROOT, stderr=log, timeout_s=timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {log_path}") from exc
    return process, int(address.rsplit(":", 1)[1])
