"""`sluice serve` (workers as subprocesses + the scheduler in this process) and
`sluice scheduler` (the scheduler alone, against running workers).

    sluice serve [--config FILE] [--workers K] [--policy P] [--model M] [--port N] [--http-port H] [--demo]
        spawn K `sluice worker --port 0` processes on loopback -> read "listening on HOST:PORT"
        from each -> wait for their liveness health -> LiveScheduler + SchedulerServer
        (Warmup, loops) -> print where it listens -> serve until SIGINT/SIGTERM (or, with
        --demo, replay a trace slice against itself with a progress bar and print the
        metrics table) -> graceful shutdown: health NOT_SERVING, in-flight streams get a
        grace period, then the workers get SIGTERM (SIGKILL if they linger)
        --http-port H (on a free port with --demo): the OpenAI HTTP API (gateway_service/) served
        by this process over the scheduler's in-process API (scheduler_service/inprocess.py),
        stopped first at shutdown; with --gateway-process, by a supervised `sluice gateway` child
        Supervisor: a worker that exits is logged with its exit code and the last lines of
        its stderr, and started again after a backoff (doubling up to restart_max_s) on the
        same port, so the scheduler's reconnect finds it; when that port is taken it starts
        on a new one and the scheduler is told the new address.
        --worker-cpus / --predictor-cpus / --scheduler-cpus pin the workers, the predictor and
        this process to CPU sets (services/affinity.py): the predictor on cores of its own, as
        its own container has. Given none of them, CPU workers (torch or vllm engine) are placed
        automatically where there are more cores than workers (services/placement.py): each
        worker on cores of its own, the scheduler, predictor and gateway on the rest;
        --no-auto-pin leaves every process on every CPU.
    sluice serve --prefill-workers N --decode-workers M [...]
        disaggregated: N `sluice worker --role prefill` and M `--role decode` processes; the
        scheduler builds a DisaggCluster from the roles they announce and drives the KV
        transfers between them (scheduler_service/live/transfers.py)
    sluice scheduler --worker HOST:PORT [--worker ...] [--policy P] [--port N] [--http-port H]
        (disaggregated when the workers were started with --role prefill / --role decode)
    sluice scheduler --workers-dns NAME:PORT [--workers-dns-refresh-s S]
        the workers are every address NAME resolves to (a Kubernetes headless Service),
        re-resolved every S seconds: workers join and leave without a restart
        (scheduler_service/live/discovery.py); --worker and --workers-dns combine

Security (SecurityConfig, shared with the worker): api_key clients must send; tls_cert,
tls_key, tls_ca turn on TLS (mutual with a CA) for the scheduler's port and, with `serve`, the
workers' (the same files); the scheduler dials its workers with them, presenting
worker_api_key (default: the first api_key). health_port serves plaintext health for probes.

Settings come from the dataclass defaults, then the --config file (JSON, or TOML by its
.toml suffix; keys are the field names), then SLUICE_<NAME> environment variables, then the
flags given on the command line (sluice.common.config). ServeConfig extends
SchedulerServiceConfig, which extends the live scheduler's LiveConfig: one definition of
every setting and its default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlparse

from scheduler_service.live.config import LiveConfig
from services.affinity import can_pin, child_cpus, parse_cpus, pin_self, start_cpus
from services.child import launcher_command, listening_address
from services.placement import Placement, auto_placement
from sluice.common.config import add_config_arguments, config_from, opt, subset
from sluice.common.security import (
    ClientSecurity,
    SecurityConfig,
    ServerSecurity,
    redacted,
    setup_logging,
    split_keys,
)

log = logging.getLogger(__name__)


@dataclass
class SchedulerServiceConfig(LiveConfig, SecurityConfig):
    """`sluice scheduler`: the live scheduler, where it listens, who may call it, and the
    workers it drives."""

    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(50051, "port to listen on (0 picks a free one)")
    worker: list[str] = opt(
        default_factory=list, help="HOST:PORT of a running worker (repeat the flag, or a comma-separated list)"
    )
    workers_dns: list[str] = opt(
        default_factory=list,
        help="NAME:PORT resolved to the workers, every address one (a headless Service); re-resolved to scale",
    )
    workers_dns_refresh_s: float = opt(5.0, "seconds between two resolutions of workers_dns")
    workers_dns_drop_after: int = opt(2, "a worker leaves after this many resolutions in a row without its address")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port")
    http_port: int | None = opt(
        None, "also serve the OpenAI HTTP API on this port of host, from this process (0 picks a free one)"
    )
    grace_s: float = opt(5.0, "seconds in-flight streams get to finish at shutdown")
    worker_api_key: str | None = opt(
        None,
        "the API key the workers require; none: `sluice serve` makes one per run (its children alone know it), "
        "`sluice scheduler` uses the first of api_key",
    )

    def live_config(self) -> LiveConfig:
        return subset(LiveConfig, self)

    def worker_key(self) -> str | None:
        keys = split_keys(self.api_key)
        return self.worker_api_key or (keys[0] if keys else None)


@dataclass
class ServeConfig(SchedulerServiceConfig):
    """`sluice serve`: the scheduler plus the worker processes it starts."""

    workers: int = opt(2, "worker processes to start (mixed: each prefills and decodes)")
    http_port: int | None = opt(
        None,
        "also serve the OpenAI HTTP API on this port of host (0 picks a free one); "
        "none: not served, except with --demo (on a free port)",
    )
    # NOTE: in-process by default, measured (docs/results/openai_api.md): on two shared cores a
    # child's extra hop added 1-2 ms to TTFT and took 15-25% of the saturated throughput.
    gateway_process: bool = opt(
        False,
        "serve the OpenAI HTTP API from a `sluice gateway` child process (its own event loop and core, restarted "
        "when it exits) instead of from the scheduler's process",
    )
    prefill_workers: int = opt(0, "disaggregated: prefill-only workers to start (with --decode-workers; not --workers)")
    decode_workers: int = opt(0, "disaggregated: decode-only workers to start (with --prefill-workers)")
    model: str = opt("tiny-llama", "model preset or checkpoint folder of the workers")
    engine: str = opt("torch", "the workers' engine: torch (ours), vllm (vLLM's model runner) or echo")
    dtype: str = opt("auto", "the workers' dtype: auto, float32, float16 or bfloat16")
    vllm_compile: bool = opt(True, "with --engine vllm: vLLM compiles its model (--no-vllm-compile: eager)")
    load_format: str = opt("auto", "auto, dummy or safetensors")
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    # NOTE: a CPU worker left to measure would size its KV cache from most of the machine's free
    # RAM; the launcher gives its CPU workers a fixed pool instead (None lets a GPU worker measure).
    num_gpu_blocks: int | None = opt(512, "KV blocks per worker; none: each worker measures its device")
    swap_space_gib: float = opt(0.05, "host swap space per worker in GiB")
    worker_threads: int = opt(0, "torch threads per worker; 0: the cores (of worker_cpus when set) shared out evenly")
    worker_start_timeout_s: float = opt(120.0, "seconds a worker gets to start and answer health")
    worker_host: str = opt("127.0.0.1", "address the workers listen on (loopback: only this machine reaches them)")
    restart_min_s: float = opt(1.0, "first delay before restarting a worker that exited")
    restart_max_s: float = opt(30.0, "the restart delay doubles up to this (and resets after a minute of uptime)")
    start_predictor: bool = opt(
        True, "start a length predictor process beside the workers (not when --predictor names a running one)"
    )
    redis_url: str | None = opt(
        "redis://127.0.0.1:6379/0", "Redis for the predictor's query cache and history, used when it answers"
    )
    # NOTE: on a machine the workers share, the predictor's encoder competes with their steps for
    # the cores; at a lower priority it uses what they leave (its answers are never awaited).
    predictor_niceness: int = opt(10, "scheduling niceness of the predictor process (0: the same as the workers)")
    # NOTE: off by default, measured (docs/results/predictor.md, "Live TTFT with the predictor"): idle priority
    # took 13% instead of 17% onto the TTFT p50 of uncached prompts but let only 26 of 40 answers
    # arrive in time instead of 37, and under full load an idle-class process would answer nothing.
    predictor_idle: bool = opt(
        False,
        "run the predictor at idle CPU priority as well (Linux SCHED_IDLE): it only takes a core the workers "
        "and the scheduler leave free, so fewer of its answers arrive while they matter",
    )
    # NOTE: off by default. Pinned apart, the predictor's encoder cannot take a core from a worker's
    # prefill, as when it runs as its own container (docker-compose, Kubernetes); scheduler_cpus
    # places this process too (measured: docs/results/predictor.md, "Live TTFT with the predictor").
    worker_cpus: str | None = opt(
        None, "CPUs the workers are pinned to, like 0-3 or 0,2-3 (all share the set); none: see auto_pin"
    )
    predictor_cpus: str | None = opt(None, "CPUs the predictor process is pinned to, like 4 or 4-5; none: see auto_pin")
    scheduler_cpus: str | None = opt(
        None, "CPUs this process (the scheduler) is pinned to once its children started; none: see auto_pin"
    )
    # NOTE: on by default, measured (docs/results/vllm_engine.md, "The product default"): unpinned,
    # the scheduler takes the worker's core in turns; services/placement.py has the rule and its why.
    auto_pin: bool = opt(
        True,
        "when no CPU list is given: each CPU worker (torch or vllm engine) on cores of its own (the highest), the "
        "scheduler, predictor and gateway on the rest, where there are more cores than workers; --no-auto-pin: "
        "every process on every CPU",
    )

    def worker_cpu_set(self) -> frozenset[int] | None:
        return parse_cpus(self.worker_cpus, "worker_cpus")

    def predictor_cpu_set(self) -> frozenset[int] | None:
        return parse_cpus(self.predictor_cpus, "predictor_cpus")

    def scheduler_cpu_set(self) -> frozenset[int] | None:
        return parse_cpus(self.scheduler_cpus, "scheduler_cpus")

    def placement(self) -> Placement:
        """The automatic CPU placement (services/placement.py), when auto_pin is on, no CPU list
        is given and this OS can pin; else not placed. The same answer at every call: it reads
        the CPUs this process started with, so a restarted worker goes back to its own cores."""
        if not self.auto_pin or not can_pin() or self.worker_cpus or self.scheduler_cpus or self.predictor_cpus:
            return Placement()
        # NOTE: start_predictor alone, not whether a predictor address is set: serve() sets it to
        # the child's once started, and the placement must not move for a restarted child
        helpers = 1 + self.start_predictor + self.gateway_process
        return auto_placement(
            start_cpus(), len(worker_roles(self)), self.engine, self.device, self.worker_threads, helpers
        )

    def worker_cpu_set_of(self, worker_id: int) -> frozenset[int] | None:
        """The CPUs worker `worker_id` is pinned to: worker_cpus, else its automatic place."""
        placement = self.placement()
        return placement.workers[worker_id] if placement.placed else self.worker_cpu_set()

    def others_cpu_set(self, explicit: frozenset[int] | None) -> frozenset[int] | None:
        """A scheduler-side process's CPUs: its own list, else the automatic placement's rest."""
        placement = self.placement()
        return placement.others if placement.placed else explicit


# ---------------------------------------------------------------- worker processes

STDERR_TAIL_LINES = 20
HEALTHY_UPTIME_S = 60.0  # a worker that lived this long restarts after the shortest delay again


@dataclass
class WorkerProcess:
    """A child process of `sluice serve`: a worker (worker_id >= 0) or the predictor (-1)."""

    worker_id: int
    proc: asyncio.subprocess.Process
    address: str = ""
    scheduler_port: int = 0  # the gateway's: the scheduler it fronts
    started_at: float = field(default_factory=time.monotonic)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    _drains: list[asyncio.Task] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1]) if self.address else 0

    @property
    def name(self) -> str:
        return f"worker {self.worker_id}" if self.worker_id >= 0 else _CHILD_NAMES[self.worker_id]


def worker_roles(cfg: ServeConfig) -> list[str]:
    """Each worker's role, by worker id: `workers` mixed ones, or (disaggregated) the prefill
    workers then the decode workers. ValueError naming the field for a split that cannot serve."""
    if cfg.prefill_workers < 0 or cfg.decode_workers < 0:
        raise ValueError("prefill_workers, decode_workers: must be >= 0")
    if not cfg.prefill_workers and not cfg.decode_workers:
        if cfg.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {cfg.workers}")
        return ["mixed"] * cfg.workers
    if not cfg.prefill_workers or not cfg.decode_workers:
        field = "prefill_workers" if not cfg.prefill_workers else "decode_workers"
        raise ValueError(f"{field}: a disaggregated cluster needs both prefill and decode workers (>= 1 each)")
    return ["prefill"] * cfg.prefill_workers + ["decode"] * cfg.decode_workers


def threads_per_worker(cfg: ServeConfig, worker_id: int = 0) -> int:
    """Torch threads per worker: worker_threads, else the workers' cores shared out evenly (the
    pinned set when worker_cpus is given: more threads than its cores would only wait), or the
    worker's own cores when placed automatically."""
    if cfg.worker_threads:
        return cfg.worker_threads
    placement = cfg.placement()
    if placement.placed:
        return len(placement.workers[worker_id])
    pinned = cfg.worker_cpu_set()
    cores = len(pinned) if pinned else (os.cpu_count() or 1)
    return max(1, cores // len(worker_roles(cfg)))


def worker_command(cfg: ServeConfig, worker_id: int, port: int = 0) -> list[str]:
    roles = worker_roles(cfg)
    threads = threads_per_worker(cfg, worker_id)
    cmd = [sys.executable, "-m", "services.cli", "worker", "--host", cfg.worker_host, "--port", str(port)]
    cmd += ["--worker-id", str(worker_id), "--model", cfg.model, "--load-format", cfg.load_format]
    cmd += ["--role", roles[worker_id], "--engine", cfg.engine, "--dtype", cfg.dtype]
    cmd += ["--device", cfg.device, "--swap-space-gib", str(cfg.swap_space_gib), "--threads", str(threads)]
    if cfg.num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks", str(cfg.num_gpu_blocks)]
    if not cfg.vllm_compile:
        cmd.append("--no-vllm-compile")
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--tls-ca", cfg.tls_ca)):
        if path:
            cmd += [flag, path]
    return cmd


def worker_environment(cfg: ServeConfig) -> dict[str, str]:
    """Our environment without SLUICE_* settings (they are the scheduler's: a health or metrics
    port would clash), with the workers' API key; data and telemetry settings pass."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    key = cfg.worker_key()
    if key:
        env["SLUICE_API_KEY"] = key  # NOTE: in the environment, not on a command line others can read
    role = scheduler_role(cfg)
    if role:
        env["SLUICE_TLS_CLIENT_ROLES"] = role  # only certificates of our own role drive them
    return env


def scheduler_role(cfg: ServeConfig) -> str | None:
    """Under mutual TLS, the role (subject OU) of the certificate the scheduler dials its
    children with: the only one they accept (a client's certificate, same CA, is refused)."""
    if not (cfg.tls_cert and cfg.tls_ca):
        return None
    from sluice.common.certs import certificate_role

    try:
        with open(cfg.tls_cert, "rb") as f:
            return certificate_role(f.read())
    except (OSError, ValueError):
        return None  # NOTE: ServerSecurity.from_config names an unreadable file


async def spawn_worker(cfg: ServeConfig, worker_id: int, port: int = 0) -> WorkerProcess:
    cmd = worker_command(cfg, worker_id, port)
    return await spawn_process(cmd, worker_environment(cfg), worker_id, cpus=cfg.worker_cpu_set_of(worker_id))


async def spawn_process(
    cmd: Sequence[str],
    env: dict[str, str],
    worker_id: int,
    niceness: int = 0,
    idle: bool = False,
    cpus: frozenset[int] | None = None,
) -> WorkerProcess:
    """`cmd` as a child of this process, started through services/child.py: it dies with this
    process and runs at the niceness, priority and CPUs given (set before `cmd` starts, done
    when this returns; RuntimeError naming the child when a step failed)."""
    read_fd, write_fd = os.pipe()
    try:
        launcher = launcher_command(
            cmd, write_fd, parent=os.getpid(), cpus=child_cpus(cpus), niceness=niceness, idle=idle
        )
        # NOTE: no preexec_fn: it would fork this process (gRPC threads running) and run Python
        # in the child; without one the child starts with vfork and exec (services/child.py)
        proc = await asyncio.create_subprocess_exec(
            *launcher,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            pass_fds=(write_fd,),
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    child = WorkerProcess(worker_id, proc)
    child._drains.append(asyncio.create_task(_drain_stderr(child)))
    problem = await _read_until_closed(read_fd)
    if problem:
        await stop_workers([child])
        raise RuntimeError(f"{child.name} could not be set up ({' '.join(cmd[:4])} ...): {problem}")
    return child


async def _read_until_closed(fd: int) -> str:
    """What is written to the pipe `fd` until its last writer closes it; `fd` is closed."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    data = bytearray()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        if chunk:
            data.extend(chunk)
        elif not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return data.decode(errors="replace")


PREDICTOR_ID = -1
GATEWAY_ID = -2
_CHILD_NAMES = {PREDICTOR_ID: "predictor", GATEWAY_ID: "gateway"}


def predictor_command(cfg: ServeConfig, port: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "services.cli", "predictor", "serve", "--host", cfg.worker_host, "--port", str(port)]
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--tls-ca", cfg.tls_ca)):
        if path:
            cmd += [flag, path]
    return cmd


def predictor_environment(cfg: ServeConfig) -> dict[str, str]:
    """The workers' environment plus the Redis URL: it may hold a password, so it goes in the
    environment (readable by its owner only), never on the command line `ps` shows anyone."""
    env = worker_environment(cfg)
    if cfg.redis_url and redis_answers(cfg.redis_url):
        env["SLUICE_REDIS_URL"] = cfg.redis_url
    return env


def redis_answers(url: str, timeout_s: float = 0.2) -> bool:
    """Whether something listens at the Redis URL's address (the predictor fails open either
    way; without one it keeps its cache and history in process)."""
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=timeout_s):
            return True
    except OSError:
        return False


async def spawn_predictor(cfg: ServeConfig, port: int = 0) -> WorkerProcess:
    # NOTE: `sluice predictor serve` runs one onnxruntime thread by default, one core whether
    # pinned or not, so predictor_cpus needs no thread count of its own
    return await spawn_process(
        predictor_command(cfg, port),
        predictor_environment(cfg),
        PREDICTOR_ID,
        cfg.predictor_niceness,
        cfg.predictor_idle,
        cpus=cfg.others_cpu_set(cfg.predictor_cpu_set()),
    )


async def start_predictor(cfg: ServeConfig) -> WorkerProcess | None:
    """The length predictor beside the workers (its committed model; the encoder is exported
    into the cache at first use), unless one is named or it is turned off."""
    if not cfg.start_predictor or cfg.predictor:
        return None
    child = await spawn_predictor(cfg)
    try:
        await _ready(child, cfg)
    except BaseException:
        await stop_workers([child])
        raise
    return child


def gateway_command(cfg: SchedulerServiceConfig, scheduler_port: int, http_port: int) -> list[str]:
    """`sluice gateway` in front of this scheduler: on `host` (loopback by default) like the
    scheduler, with the same TLS files (dialling the scheduler over TLS when it serves TLS)."""
    local = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    cmd = [sys.executable, "-m", "services.cli", "gateway", "--host", cfg.host, "--port", str(http_port)]
    cmd += ["--scheduler", f"{local}:{scheduler_port}"]
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key), ("--tls-ca", cfg.tls_ca)):
        if path:
            cmd += [flag, path]
    if cfg.tls_cert:
        cmd.append("--scheduler-tls")
    return cmd


def gateway_environment(cfg: SchedulerServiceConfig) -> dict[str, str]:
    """The API keys in the environment (not on a command line others can read): the gateway
    accepts the scheduler's keys and presents the first to the scheduler."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    keys = split_keys(cfg.api_key)
    if keys:
        env["SLUICE_API_KEY"] = ",".join(keys)
        env["SLUICE_SCHEDULER_API_KEY"] = keys[0]
    return env


async def start_gateway(cfg: ServeConfig, scheduler_port: int, http_port: int) -> WorkerProcess:
    """The OpenAI HTTP gateway as a child process (its own core for HTTP and JSON, off the
    scheduler's event loop), ready once it prints where it listens."""
    child = await spawn_gateway(cfg, scheduler_port, http_port)
    try:
        await _gateway_ready(child, cfg)
    except BaseException:
        await stop_workers([child])
        raise
    return child


async def start_http_front(cfg: SchedulerServiceConfig, server: Any, http_port: int) -> Any:
    """The OpenAI HTTP API served by this process, on the scheduler's event loop, over its
    in-process Generation API (scheduler_service/inprocess.py: no gRPC hop). The same keys and
    TLS files as the gRPC port; requests are owned by the first key's identity, as when a
    `sluice gateway` presents that key."""
    try:
        from gateway_service.app import Gateway
        from gateway_service.config import GatewayConfig
        from gateway_service.server import GatewayServer
    except ImportError as exc:
        raise RuntimeError(f"http_port: the OpenAI HTTP API needs the gateway extra ({exc.name} is missing)") from None
    from scheduler_service.inprocess import InProcessLink
    from sluice.common.security import ANONYMOUS, key_identity

    gcfg = GatewayConfig(host=cfg.host, port=http_port, api_key=cfg.api_key)
    gcfg.tls_cert, gcfg.tls_key, gcfg.tls_ca = cfg.tls_cert, cfg.tls_key, cfg.tls_ca
    keys = split_keys(cfg.api_key)
    link = InProcessLink(server.live, key_identity(keys[0]) if keys else ANONYMOUS)
    return await GatewayServer.start(gcfg, Gateway(gcfg, link=link))


def http_address(front: Any) -> str:
    host = front.server.servers[0].sockets[0].getsockname()[0]
    return f"{host}:{front.port}"


async def spawn_gateway(cfg: ServeConfig, scheduler_port: int, http_port: int) -> WorkerProcess:
    cmd = gateway_command(cfg, scheduler_port, http_port)
    child = await spawn_process(cmd, gateway_environment(cfg), GATEWAY_ID, cpus=cfg.others_cpu_set(None))
    child.scheduler_port = scheduler_port
    return child


async def _gateway_ready(child: WorkerProcess, cfg: ServeConfig) -> None:
    child.address = await _listening_address(child, cfg.worker_start_timeout_s)
    child._drains.append(asyncio.create_task(_drain_output(child)))


async def _listening_address(worker: WorkerProcess, timeout_s: float) -> str:
    stdout = worker.proc.stdout
    assert stdout is not None
    async with asyncio.timeout(timeout_s):
        while line := await stdout.readline():
            if address := listening_address(line):
                return address
    code = await worker.proc.wait()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(worker._drains[0]), 2.0)  # its last stderr lines
    tail = "\n".join(worker.stderr_tail) or "(nothing)"
    raise RuntimeError(f"{worker.name} exited ({exit_text(code)}) before listening; stderr:\n{tail}")


def exit_text(code: int) -> str:
    """`code 1`, or `killed by SIGSEGV` for a negative return code (a signal)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"code {code}"


async def _drain_output(worker: WorkerProcess) -> None:
    """Keeps the worker's stdout pipe from filling up; its lines go to our debug log."""
    assert worker.proc.stdout is not None
    while line := await worker.proc.stdout.readline():
        log.debug("%s: %s", worker.name, line.decode(errors="replace").rstrip())


async def _drain_stderr(worker: WorkerProcess) -> None:
    """The worker's log lines: kept (the last few) to explain an exit, and in our debug log."""
    assert worker.proc.stderr is not None
    while line := await worker.proc.stderr.readline():
        text = line.decode(errors="replace").rstrip()
        worker.stderr_tail.append(text)
        log.debug("%s stderr: %s", worker.name, text)


async def wait_for_liveness(address: str, timeout_s: float, security: ClientSecurity | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with (security or ClientSecurity()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"worker at {address} is not alive: {reply.status}")


def worker_client_security(cfg: SchedulerServiceConfig) -> ClientSecurity:
    """How the scheduler dials its workers: the same TLS files (its certificate is the client
    certificate under mutual TLS) and the workers' API key."""
    return ClientSecurity.from_config(cfg, api_key=cfg.worker_key())


async def _ready(worker: WorkerProcess, cfg: ServeConfig) -> None:
    worker.address = await _listening_address(worker, cfg.worker_start_timeout_s)
    worker._drains.append(asyncio.create_task(_drain_output(worker)))
    await wait_for_liveness(worker.address, cfg.worker_start_timeout_s, worker_client_security(cfg))


async def start_workers(cfg: ServeConfig) -> list[WorkerProcess]:
    workers: list[WorkerProcess] = []
    try:
        for w in range(len(worker_roles(cfg))):
            workers.append(await spawn_worker(cfg, w))
        await asyncio.gather(*(_ready(worker, cfg) for worker in workers))
    except BaseException:
        await stop_workers(workers)
        raise
    return workers


async def stop_workers(workers: Sequence[WorkerProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM (the worker shuts down gracefully), SIGKILL for any that lingers."""
    for worker in workers:
        if worker.proc.returncode is None:
            worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            await asyncio.wait_for(worker.proc.wait(), timeout_s)
        except TimeoutError:
            worker.proc.kill()
            await worker.proc.wait()
        for task in worker._drains:
            task.cancel()


class Supervisor:
    """Keeps `sluice serve`'s children running: the workers, the length predictor and the
    OpenAI HTTP gateway (once `watch_gateway` hands it over).

    An exit is logged with its code and the tail of the child's stderr; the child starts again
    after a backoff (restart_min_s doubling to restart_max_s; back to the minimum after a minute
    of uptime) on the port it had, where the scheduler's reconnect loop dials a worker and takes
    a new lease, and its predictor client reconnects. When that port cannot be had the child
    starts on a free one and `on_address` (the scheduler's `readdress`) or `on_predictor_address`
    is told. `on_predictor_health` hears the predictor go down and come back (readiness), as
    `on_gateway_health` hears the gateway. The gateway comes back on its own HTTP port only (the
    address clients were given); while that port cannot be had it is tried again after the
    backoff."""

    def __init__(self, cfg: ServeConfig, workers: list[WorkerProcess], predictor: WorkerProcess | None = None) -> None:
        self.cfg = cfg
        self.workers = workers
        self.predictor = predictor
        self.on_address: Callable[[int, str], None] | None = None
        self.on_predictor_address: Callable[[str], None] | None = None
        self.on_predictor_health: Callable[[bool], None] | None = None
        self.on_gateway_health: Callable[[bool], None] | None = None
        self.gateway: WorkerProcess | None = None
        self.num_restarts = 0  # of workers
        self.num_predictor_restarts = 0
        self.num_gateway_restarts = 0
        self._gateway_watch: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(w.worker_id)) for w in self.workers]
        if self.predictor is not None:
            self._tasks.append(asyncio.create_task(self._watch(PREDICTOR_ID)))

    def watch_gateway(self, gateway: WorkerProcess) -> None:
        """Supervises the gateway (started by start_gateway) from now on."""
        self.gateway = gateway
        self._gateway_watch = asyncio.create_task(self._watch(GATEWAY_ID))

    async def stop_gateway(self) -> None:
        """Stops the gateway for good (first at shutdown: no new request reaches a stopping
        scheduler); a restart under way is cancelled."""
        if self._gateway_watch is not None:
            self._gateway_watch.cancel()
            await asyncio.gather(self._gateway_watch, return_exceptions=True)
            self._gateway_watch = None
        if self.gateway is not None:
            await stop_workers([self.gateway])

    async def stop(self) -> None:
        self._stopping = True
        await self.stop_gateway()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await stop_workers([*self.workers, *([self.predictor] if self.predictor is not None else [])])

    def _child(self, child_id: int) -> WorkerProcess:
        if child_id == PREDICTOR_ID:
            assert self.predictor is not None
            return self.predictor
        if child_id == GATEWAY_ID:
            assert self.gateway is not None
            return self.gateway
        return self.workers[child_id]

    def _health(self, child_id: int, up: bool) -> None:
        hear = {PREDICTOR_ID: self.on_predictor_health, GATEWAY_ID: self.on_gateway_health}.get(child_id)
        if hear is not None:
            hear(up)

    async def _watch(self, child_id: int) -> None:
        delay = self.cfg.restart_min_s
        while not self._stopping:
            child = self._child(child_id)
            code = await child.proc.wait()
            if self._stopping:
                return
            self._health(child_id, False)
            uptime = time.monotonic() - child.started_at
            delay = self.cfg.restart_min_s if uptime >= HEALTHY_UPTIME_S else delay
            tail = "\n    ".join(child.stderr_tail) or "(nothing)"
            log.error(
                "%s (%s) exited with code %s after %.1f s; restarting in %.1f s; last stderr lines:\n    %s",
                child.name, child.address, code, uptime, delay, tail,
            )  # fmt: skip
            for task in child._drains:
                task.cancel()
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.cfg.restart_max_s)
            if child_id == PREDICTOR_ID:
                await self._restart_predictor(child)
            elif child_id == GATEWAY_ID:
                await self._restart_gateway(child)
            else:
                await self._restart(child)

    async def _restart(self, old: WorkerProcess) -> None:
        for port in dict.fromkeys((old.port, 0)):
            worker = await spawn_worker(self.cfg, old.worker_id, port)
            self.workers[old.worker_id] = worker
            try:
                await _ready(worker, self.cfg)
            except (RuntimeError, TimeoutError, OSError) as exc:
                log.error("worker %d did not come back on port %d: %s", old.worker_id, port, exc)
                continue
            self.num_restarts += 1
            log.warning("worker %d restarted at %s (pid %d)", old.worker_id, worker.address, worker.proc.pid)
            if self.on_address is not None:
                # NOTE: at once, so the scheduler dials it now (its backoff may be seconds long);
                # nobody else can take it meanwhile: the workers' key is this run's own
                self.on_address(old.worker_id, worker.address)
            return

    async def _restart_gateway(self, old: WorkerProcess) -> None:
        # NOTE: on its own port only; a failed start leaves an exited child, which the watch
        # logs and starts again after the (doubled) backoff
        try:
            gateway = await spawn_gateway(self.cfg, old.scheduler_port, old.port)
            self.gateway = gateway
            await _gateway_ready(gateway, self.cfg)
        except (RuntimeError, TimeoutError, OSError) as exc:
            log.error("the gateway did not come back on port %d: %s", old.port, exc)
            if self.gateway is not None:
                await stop_workers([self.gateway])
            return
        self.num_gateway_restarts += 1
        log.warning("gateway restarted at %s (pid %d)", gateway.address, gateway.proc.pid)
        self._health(GATEWAY_ID, True)

    async def _restart_predictor(self, old: WorkerProcess) -> None:
        for port in dict.fromkeys((old.port, 0)):
            child = await spawn_predictor(self.cfg, port)
            self.predictor = child
            try:
                await _ready(child, self.cfg)
            except (RuntimeError, TimeoutError, OSError) as exc:
                log.error("the predictor did not come back on port %d: %s", port, exc)
                continue
            self.num_predictor_restarts += 1
            log.warning("predictor restarted at %s (pid %d)", child.address, child.proc.pid)
            if child.address != old.address and self.on_predictor_address is not None:
                self.on_predictor_address(child.address)
            if self.on_predictor_health is not None:
                self.on_predictor_health(True)
            return


# ---------------------------------------------------------------- the scheduler


def worker_discovery(cfg: SchedulerServiceConfig, static: Sequence[str], resolver: Any = None) -> Any:
    """The DNS discovery of `cfg.workers_dns`, or None; `resolver` replaces the system's (tests)."""
    from scheduler_service.live.discovery import WorkerDiscovery, parse_targets

    if not cfg.workers_dns:
        return None
    extra = {"resolver": resolver} if resolver is not None else {}
    return WorkerDiscovery(
        parse_targets(cfg.workers_dns),
        cfg.workers_dns_refresh_s,
        drop_after=cfg.workers_dns_drop_after,
        static=static,
        **extra,
    )


async def start_scheduler(cfg: SchedulerServiceConfig, addresses: Sequence[str], *, resolver: Any = None) -> Any:
    """The scheduler over `addresses` and, with `cfg.workers_dns`, every worker the names
    resolve to (waiting up to connect_timeout_s for the first), kept in step with them."""
    from scheduler_service.live.service import LiveScheduler
    from scheduler_service.server import SchedulerServer
    from sluice.common.telemetry import setup_tracing

    discovery = worker_discovery(cfg, addresses, resolver)
    if discovery is not None:
        addresses = [*addresses, *await discovery.initial(cfg.connect_timeout_s)]

    setup_tracing("sluice-scheduler")
    security = ServerSecurity.from_config(cfg)
    serving = None
    if cfg.metrics_port is not None:
        from sluice.common.prom import ServingMetrics, start_metrics_server

        serving = ServingMetrics(getattr(cfg, "model", ""))
        port = start_metrics_server(cfg.metrics_port, serving, cfg.host)
        print(f"sluice metrics on http://{cfg.host}:{port}/metrics", flush=True)
    live = LiveScheduler(
        addresses, cfg.live_config(), serving, security=worker_client_security(cfg), discovery=discovery
    )
    return await SchedulerServer.start(live, cfg.port, host=cfg.host, security=security, health_port=cfg.health_port)


def _describe(server: Any) -> str:
    grpc_server = server.grpc
    health = f"; plaintext health on port {grpc_server.health_port}" if grpc_server.health_port is not None else ""
    return f"{grpc_server.security.describe()}{health}"


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _until(stop: asyncio.Event, work: Any) -> None:
    """Runs `work` (a coroutine) until it ends or `stop` is set, whichever comes first."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def serve(cfg: ServeConfig, demo: DemoOptions | None = None) -> int:
    stop = _stop_event()
    http_port = 0 if cfg.http_port is None and demo is not None else cfg.http_port
    roles = worker_roles(cfg)
    split = "" if roles[0] == "mixed" else f" ({cfg.prefill_workers} prefill, {cfg.decode_workers} decode)"
    print(f"starting {len(roles)} {cfg.model} workers{split} on {cfg.device} ...", flush=True)
    placement = cfg.placement()
    if placement.placed:
        print(f"CPU placement (automatic; --no-auto-pin turns it off): {placement.describe()}", flush=True)
    elif placement.note:
        log.warning("%s", placement.note)
    cfg.worker_api_key = cfg.worker_api_key or private_worker_key()
    supervisor = Supervisor(cfg, await start_workers(cfg))
    front = None
    try:
        supervisor.predictor = await start_predictor(cfg)
        if supervisor.predictor is not None:
            cfg.predictor = supervisor.predictor.address
            print(f"sluice length predictor at {cfg.predictor}", flush=True)
        pin_self(cfg.others_cpu_set(cfg.scheduler_cpu_set()))
        server = await start_scheduler(cfg, [w.address for w in supervisor.workers])
        supervisor.on_address = server.live.readdress
        supervisor.on_predictor_address = server.live.readdress_predictor
        supervisor.on_predictor_health = partial(_child_health, server, PREDICTOR_HEALTH)
        supervisor.on_gateway_health = partial(_child_health, server, GATEWAY_HEALTH)
        if supervisor.predictor is not None:
            _child_health(server, PREDICTOR_HEALTH, True)
        supervisor.start()
        try:
            where = ", ".join(w.address for w in supervisor.workers)
            print(
                f"sluice scheduler listening on {cfg.host}:{server.port} "
                f"(policy {cfg.policy}, router {cfg.router}, model {cfg.model}; workers {where}) [{_describe(server)}]",
                flush=True,
            )
            if http_port is not None and cfg.gateway_process:
                gateway = await start_gateway(cfg, server.port, http_port)
                supervisor.watch_gateway(gateway)
                _child_health(server, GATEWAY_HEALTH, True)
                print_http_address(cfg, gateway.address, "a `sluice gateway` child")
            elif http_port is not None:
                front = await start_http_front(cfg, server, http_port)
                _child_health(server, GATEWAY_HEALTH, True)
                print_http_address(cfg, http_address(front), "this process")
            await _until(stop, run_demo(server, cfg, demo) if demo else stop.wait())
        finally:
            print("sluice shutting down", flush=True)
            # HTTP first: no new request reaches a stopping scheduler
            await supervisor.stop_gateway()
            if front is not None:
                await front.stop()
            await server.stop(cfg.grace_s)
    finally:
        await supervisor.stop()
    return 0


def print_http_address(cfg: SchedulerServiceConfig, address: str, where: str) -> None:
    scheme = "https" if cfg.tls_cert else "http"
    model = getattr(cfg, "model", "")
    print(f"sluice OpenAI API at {scheme}://{address}/v1 ({f'model {model}, ' if model else ''}{where})", flush=True)


PREDICTOR_HEALTH = "sluice.v1.PredictorService"  # its status on the scheduler's health service
GATEWAY_HEALTH = "sluice.OpenAIGateway"  # the HTTP gateway child's status there


def _child_health(server: Any, name: str, up: bool) -> None:
    """A supervised child's state (the predictor's, the gateway's) as a named status of the
    scheduler's standard health. Readiness of the whole stays the workers': requests fall back
    to max_tokens while the predictor is away, and gRPC clients never need the gateway."""
    from sluice.common.grpc_server import NOT_SERVING, SERVING

    task = asyncio.ensure_future(server.health.set(name, SERVING if up else NOT_SERVING))
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Future] = set()


def private_worker_key() -> str:
    """A key only this `sluice serve` run and its children know (they get it in their
    environment): its workers and predictor refuse every other caller, client keys included."""
    return secrets.token_urlsafe(32)


async def serve_scheduler(cfg: SchedulerServiceConfig) -> int:
    if not cfg.worker and not cfg.workers_dns:
        raise ValueError(
            "the scheduler needs workers: give --worker HOST:PORT (or SLUICE_WORKER) or --workers-dns NAME:PORT "
            "(or SLUICE_WORKERS_DNS)"
        )
    stop = _stop_event()
    server = await start_scheduler(cfg, cfg.worker)
    front = None
    try:
        # NOTE: the HTTP line before the "listening on" one: a launcher that waits for that line
        # may stop reading our stdout once it has it (services/child.py)
        if cfg.http_port is not None:
            front = await start_http_front(cfg, server, cfg.http_port)
            print_http_address(cfg, http_address(front), "this process")
        found = f"; discovered by DNS: {', '.join(cfg.workers_dns)}" if cfg.workers_dns else ""
        print(
            f"sluice scheduler listening on {cfg.host}:{server.port} (policy {cfg.policy}, router {cfg.router}, "
            f"model {server.live.model}; workers {', '.join(server.live.worker_addresses())}{found}) "
            f"[{_describe(server)}]",
            flush=True,
        )
        await stop.wait()
    finally:
        print("sluice scheduler shutting down", flush=True)
        if front is not None:
            await front.stop()
        await server.stop(cfg.grace_s)
    return 0


# ---------------------------------------------------------------- the demo


@dataclass
class DemoOptions:
    trace: str = "azure-conv"
    num_requests: int = 40
    duration_s: float = 8.0  # the slice's arrivals are compressed into this many seconds
    prompt_scale: float = 1 / 8  # trace lengths shrunk to fit the tiny model
    output_scale: float = 1 / 4
    max_prompt: int = 256
    max_output: int = 64
    ttft_ms: float = 2000.0
    tbt_ms: float = 250.0


@dataclass(frozen=True)
class DemoRequest:
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int


def demo_requests(opts: DemoOptions, model: str) -> list[DemoRequest]:
    """A slice of a real trace, lengths scaled and clipped; prompts are windows of real
    ShareGPT text tokenized with the model's tokenizer, cut to the trace's lengths."""
    from scheduler_service.workloads import load_trace
    from sluice.common.tokenizer import Tokenizer

    trace = load_trace(opts.trace, num_requests=opts.num_requests).requests
    corpus = Tokenizer.for_model(model).encode(" ".join(_demo_texts(20)))
    span = max((r.arrival_s or 0.0) for r in trace) or 1.0
    out = []
    for i, r in enumerate(trace):
        n_prompt = int(min(opts.max_prompt, max(8, round(r.prompt_tokens * opts.prompt_scale))))
        n_out = int(min(opts.max_output, max(4, round(r.output_tokens * opts.output_scale))))
        start = (i * 97) % max(1, len(corpus) - n_prompt)
        arrival = (r.arrival_s or 0.0) * opts.duration_s / span
        out.append(DemoRequest(arrival, corpus[start : start + n_prompt], n_out))
    return out


DEMO_TEXTS = "prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz"  # bundled in data/


def _demo_texts(n: int) -> list[str]:
    from sluice.common.paths import data_file, open_text

    texts = []
    with open_text(data_file(DEMO_TEXTS)) as f:
        for line in f:
            turns = json.loads(line).get("conversations", [])
            texts += [t["value"] for t in turns[:2]]
            if len(texts) >= n:
                break
    return texts


async def run_demo(server: Any, cfg: ServeConfig, opts: DemoOptions) -> None:
    from tqdm import tqdm

    from scheduler_service.sim.report import format_table
    from scheduler_service.sim.simulator import SimRun
    from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    requests = demo_requests(opts, cfg.model)
    slo = common_pb2.SloSpec(ttft_ms=opts.ttft_ms, tbt_ms=opts.tbt_ms)
    bar = tqdm(total=len(requests), desc=f"demo {opts.trace} x{len(requests)}", unit="req")
    tokens = 0

    async def one(stub: Any, i: int, r: DemoRequest, start: float) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, start + r.arrival_s - loop.time()))
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        msg = generation_pb2.GenerateRequest(
            request_id=f"demo-{i}", token_ids=common_pb2.TokenIds(ids=r.prompt_ids), sampling_params=sampling, slo=slo
        )
        async for m in stub.Generate(msg, metadata=client.metadata):
            tokens += len(m.token_ids)
            bar.set_postfix(tokens=tokens, refresh=False)
        bar.update(1)

    loop = asyncio.get_running_loop()
    client = ClientSecurity.from_config(cfg, api_key=next(iter(split_keys(cfg.api_key)), None))
    async with client.channel(f"127.0.0.1:{server.port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        start = loop.time()
        await asyncio.gather(*(one(stub, i, r, start) for i, r in enumerate(requests)))
    bar.close()
    metrics = server.live.metrics
    run = SimRun(
        cfg.policy,
        f"{opts.trace}[:{len(requests)}] scaled",
        redacted(asdict(cfg)),
        metrics.summary(),
        metrics.details(),
    )
    print(
        f"live: {len(requests)} requests of {opts.trace} (prompts x{opts.prompt_scale:g} <= {opts.max_prompt}, "
        f"outputs x{opts.output_scale:g} <= {opts.max_output}) over {opts.duration_s:g} s, "
        f"SLO TTFT {opts.ttft_ms:g} ms / TBT {opts.tbt_ms:g} ms, {len(worker_roles(cfg))} x {cfg.model} on {cfg.device}"
    )
    print(format_table([run]))
    link = server.live.predictor
    if link is not None:
        print(
            f"length predictor: {link.num_applied} of {len(requests)} requests got its prediction while live "
            f"({link.num_late} answers came after their request ended; the rest fell back to max_tokens)"
        )


# ---------------------------------------------------------------- command lines


# `sluice serve` starts its own workers: it takes no worker addresses.
SERVE_EXCLUDES = ("worker", "workers_dns", "workers_dns_refresh_s", "workers_dns_drop_after")


def add_serve_arguments(p: argparse.ArgumentParser, *, workers: bool) -> None:
    """Flags from the config dataclass (ServeConfig for `serve`, SchedulerServiceConfig for
    `scheduler`); each also reads SLUICE_<NAME> from the environment."""
    p.add_argument("--config", help="settings file: JSON, or TOML (.toml); keys are the settings' field names")
    if workers:
        add_config_arguments(p, ServeConfig, exclude=SERVE_EXCLUDES)
        p.add_argument("--demo", action="store_true", help="replay a slice of azure-conv against itself, then exit")
        p.add_argument("--demo-requests", type=int, default=40)
    else:
        add_config_arguments(p, SchedulerServiceConfig)


def _logging() -> None:
    setup_logging(logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    _logging()
    cfg = config_from(ServeConfig, args, file=args.config, exclude=SERVE_EXCLUDES)
    try:
        check_serve_config(cfg)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    demo = DemoOptions(num_requests=args.demo_requests) if args.demo else None
    return asyncio.run(serve(cfg, demo))


def check_serve_config(cfg: ServeConfig) -> None:
    """Every option, before a child starts (ValueError naming it): the workers' split and CPU
    lists, the scheduler's options (policy and router options included), the TLS files."""
    from scheduler_service.live.validate import check_live_config

    worker_roles(cfg)
    cfg.worker_cpu_set()
    cfg.predictor_cpu_set()
    cfg.scheduler_cpu_set()
    check_live_config(cfg.live_config())
    ServerSecurity.from_config(cfg)
    for name in ("restart_min_s", "restart_max_s", "worker_start_timeout_s", "grace_s"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(cfg, name)!r}")
    if cfg.num_gpu_blocks is not None and cfg.num_gpu_blocks < 1:
        raise ValueError(f"num_gpu_blocks: must be >= 1 (or none), got {cfg.num_gpu_blocks!r}")


def cmd_scheduler(args: argparse.Namespace) -> int:
    from scheduler_service.live.discovery import NoWorkerFound
    from scheduler_service.live.remote import WorkerLost

    _logging()
    try:
        return asyncio.run(serve_scheduler(config_from(SchedulerServiceConfig, args, file=args.config)))
    except (NoWorkerFound, WorkerLost) as exc:  # an orchestrator restarts us; the line says what was waited for
        print(f"error: {exc}", file=sys.stderr)
        return 1
