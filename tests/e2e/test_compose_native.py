"""docker-compose.yml run without a container engine: every service of the default profile
started natively from what the file and the images say, then `sluice bench` through it (over
gRPC, and over the gateway's OpenAI API with `--backend openai`), so
the wiring in the file (addresses, ports, variables, health checks, start order) is proven
where no Docker exists.

    compose file + .env (COMPOSE_PROFILES) -> the active services, ${VAR:-default} resolved
    each Sluice service: the image's ENTRYPOINT (`sluice ...` = python -m services.cli ...)
        with the image's ENV under compose's `environment:`, unchanged except:
          every listening port -> a free loopback port, and every `service:port` in a value
          -> 127.0.0.1:<its port>; SLUICE_HOST 0.0.0.0 -> 127.0.0.1;
          image paths -> their sources here (/opt/sluice/data -> data/, the predictor model
          the image exports at build -> the same export into a temporary folder, volumes ->
          temporary folders)
    redis: compose's command, on its remapped port
    otel-collector: an OTLP/gRPC trace receiver in this test on its remapped port (what the
        collector's pipeline receives); jaeger, fed only by the collector, is not started
    prometheus: this test scrapes every target of deploy/prometheus/prometheus.yml (remapped)
    start order: depends_on, with each health check command run natively until it passes
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sluice.common.paths import repo_root

pytestmark = pytest.mark.slow

ROOT = repo_root()
COMPOSE = ROOT / "docker-compose.yml"
SLUICE_PORT_VARIABLES = ("SLUICE_PORT", "SLUICE_METRICS_PORT")
# Ports the third-party images listen on (their documented defaults, as the compose file uses them).
IMAGE_PORTS = {"redis": (6379,), "otel-collector": (4317,)}
NOT_PROCESSES_HERE = {"jaeger", "prometheus"}  # fed or played by this test (see the docstring)
NUM_REQUESTS = 6


# ---------------------------------------------------------------- reading the files


def dotenv() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / ".env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """compose's ${VAR} and ${VAR:-default}, recursively."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: variables.get(m.group(1)) or (m.group(2) or ""), value)


def active_services(compose: dict[str, Any], profiles: set[str]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or profiles & set(s["profiles"])}


def final_stage(dockerfile: Path) -> list[str]:
    """The instructions of the last stage, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    last = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[last:]


def image_environment(dockerfile: Path) -> dict[str, str]:
    env = {}
    for line in final_stage(dockerfile):
        if line.startswith("ENV "):
            env |= dict(re.findall(r"(\w+)=(\S+)", line[4:]))
    env.pop("PATH", None)  # the image's venv; here, this interpreter's
    return env


def image_entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [line for line in final_stage(dockerfile) if line.startswith("ENTRYPOINT ")]
    words = json.loads(line.removeprefix("ENTRYPOINT "))
    assert words[0] == "sluice", words
    return [sys.executable, "-m", "services.cli", *words[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the native stack


class NativeStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.variables = {**dotenv(), **{k: v for k, v in os.environ.items() if k == "COMPOSE_PROFILES"}}
        compose = interpolate(yaml.safe_load(COMPOSE.read_text()), {})
        profiles = set(self.variables.get("COMPOSE_PROFILES", "").split(","))
        self.services = active_services(compose, profiles)
        self.envs = {name: self._raw_environment(s) for name, s in self.services.items()}
        self.ports = {
            (name, port): free_port() for name in self.services for port in self._listening(name)
        }  # (service, port in the container) -> loopback port here
        self.paths = {
            "/opt/sluice/data": str(ROOT / "data"),
            "/opt/sluice/predictor-model": str(tmp / "predictor-model"),
            "/var/lib/sluice/predictor": str(tmp / "predictor-artifacts"),
            "/models": str(tmp / "model-weights"),
        }
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def _raw_environment(self, service: dict[str, Any]) -> dict[str, str]:
        env = {}
        if "build" in service:
            env |= image_environment(ROOT / service["build"]["dockerfile"])
        return env | {k: str(v) for k, v in (service.get("environment") or {}).items()}

    def _listening(self, name: str) -> list[int]:
        env = self.envs[name]
        ports = [int(env[v]) for v in SLUICE_PORT_VARIABLES if v in env]
        return ports or list(IMAGE_PORTS.get(name, ()))

    def address(self, name: str, port: int) -> str:
        return f"127.0.0.1:{self.ports[name, port]}"

    def environment(self, name: str) -> dict[str, str]:
        """The service's variables with addresses, ports and image paths made native."""
        env = {}
        for key, value in self.envs[name].items():
            if key in SLUICE_PORT_VARIABLES:
                value = str(self.ports[name, int(value)])
            elif key == "SLUICE_HOST" and value == "0.0.0.0":
                value = "127.0.0.1"
            for (other, port), here in self.ports.items():
                value = re.sub(rf"(?<![\w.-]){re.escape(other)}:{port}(?!\d)", f"127.0.0.1:{here}", value)
            for image_path, native in self.paths.items():
                if value == image_path or value.startswith(image_path + "/"):
                    value = native + value[len(image_path) :]
            env[key] = value
        return env

    def order(self) -> Iterator[str]:
        done: set[str] = set()

        def visit(name: str) -> Iterator[str]:
            if name in done:
                return
            done.add(name)
            for dep, rule in (self.services[name].get("depends_on") or {}).items():
                if dep in self.services:
                    yield from visit(dep)
                else:
                    assert rule.get("required") is False, f"{name} depends on {dep}, which is not active"
            yield name

        for name in self.services:
            yield from visit(name)

    # ------------------------------------------------------------ processes
    def start(self, name: str) -> None:
        service = self.services[name]
        if "build" in service:
            command = image_entrypoint(ROOT / service["build"]["dockerfile"])
        elif name == "redis":
            command = [*service["command"], "--bind", "127.0.0.1", "--port", str(self.ports[name, 6379])]
        else:
            raise AssertionError(f"no native command for {name}")
        env = {"PATH": os.environ["PATH"], "HOME": str(self.tmp), "PYTHONPATH": str(ROOT), **self.environment(name)}
        self.logs[name] = self.tmp / f"{name}.log"
        with self.logs[name].open("wb") as log:
            self.processes[name] = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def health_command(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        command = test[1:]
        if command[0] == "python":
            return [sys.executable, *command[1:]]
        if command == ["redis-cli", "ping"]:
            return ["redis-cli", "-p", str(self.ports[name, 6379]), "ping"]
        raise AssertionError(f"no native health check for {name}: {test}")

    async def wait_healthy(self, name: str, timeout_s: float = 240.0) -> None:
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **self.environment(name)}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            process = self.processes[name]
            assert process.poll() is None, f"{name} exited ({process.returncode}):\n{self.tail(name)}"
            check = await asyncio.create_subprocess_exec(
                *self.health_command(name), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if await check.wait() == 0:
                return
            assert loop.time() < deadline, f"{name} not healthy within {timeout_s:g} s:\n{self.tail(name)}"
            await asyncio.sleep(0.5)

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---------------------------------------------------------------- the collector's stand-in


async def start_otlp_receiver(port: int) -> tuple[grpc.aio.Server, set[str]]:
    """An OTLP/gRPC trace receiver: the service names of the spans it is sent."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    services: set[str] = set()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        async def Export(self, request: Any, context: Any) -> Any:
            for spans in request.resource_spans:
                for attribute in spans.resource.attributes:
                    if attribute.key == "service.name":
                        services.add(attribute.value.string_value)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, services


async def warm_up_predictor(address: str) -> None:
    """One prediction before the load: the first one loads the served model's tokenizer and
    warms the encoder, longer than the scheduler's prediction deadline."""
    from sluice.v1 import predictor_pb2, predictor_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = predictor_pb2_grpc.PredictorServiceStub(channel)
        request = predictor_pb2.PredictRequest(request_id="warm-up", model="tiny-llama", max_tokens=16)
        request.token_ids.ids.extend(range(1000, 1032))
        await stub.Predict(request, timeout=60)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def metric_sum(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


# ---------------------------------------------------------------- the test


async def test_the_compose_stack_started_natively_serves_a_bench(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed: the compose file's redis cannot run natively here")
    stack = NativeStack(tmp_path)
    assert {"redis", "predictor", "worker-1", "worker-2", "scheduler", "gateway", "otel-collector"} <= set(
        stack.services
    )
    assert not any(name.endswith("-gpu") for name in stack.services), "the default profile starts CPU workers"
    # the predictor image's build step, natively: the model with its encoder exported to ONNX
    model = stack.paths["/opt/sluice/predictor-model"]
    export = subprocess.run(
        [sys.executable, "-m", "services.cli", "predictor", "export", "--out", model],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    for volume in ("/var/lib/sluice/predictor", "/models"):
        Path(stack.paths[volume]).mkdir()
    receiver = None
    try:
        for name in stack.order():
            if name in NOT_PROCESSES_HERE:
                continue
            if name == "otel-collector":
                receiver, spans_from = await start_otlp_receiver(stack.ports[name, 4317])
                continue
            stack.start(name)
            if "healthcheck" in stack.services[name]:
                # what depends_on's service_healthy waits for; started services are waited on
                # by their dependants only when the file says so, but every one must pass
                await stack.wait_healthy(name)

        scheduler = stack.address("scheduler", int(stack.envs["scheduler"]["SLUICE_PORT"]))
        await warm_up_predictor(stack.address("predictor", int(stack.envs["predictor"]["SLUICE_PORT"])))
        out = tmp_path / "bench.json"
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "bench", "--target", scheduler, "--trace", "azure-conv",
            "--rate", "4", "--num-requests", str(NUM_REQUESTS), "--max-tokens", "16", "--json", str(out),
            "--no-progress", cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(bench.communicate(), timeout=240)
        assert bench.returncode == 0, output.decode()[-3000:]
        metrics = json.loads(out.read_text())["metrics"]
        assert metrics["num_requests"] == NUM_REQUESTS and metrics["num_finished"] == NUM_REQUESTS, metrics

        # Prometheus' targets, as its config names them
        config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
        pages = {}
        for job in config["scrape_configs"]:
            for target in (t for sc in job["static_configs"] for t in sc["targets"]):
                host, port = target.rsplit(":", 1)
                pages[target] = scrape(stack.address(host, int(port)))
        assert metric_sum(pages["scheduler:9400"], "sluice_request_success_total") == NUM_REQUESTS
        assert all(metric_sum(pages[f"worker-{i}:9401"], "sluice_worker_steps_total") > 0 for i in (1, 2)), (
            "both workers served steps"
        )
        # the scheduler asked the predictor about every request (each one a cache lookup: whether
        # the answer beat the scheduler's deadline depends on the cores the workers leave it),
        # and the predictor's cache and history live in the compose file's Redis
        predictor = pages["predictor:9402"]
        assert metric_sum(predictor, "sluice_predictor_cache_total") >= NUM_REQUESTS + 1, predictor[:2000]
        assert metric_sum(predictor, "sluice_predictor_redis_available") == 1
        assert metric_sum(predictor, "sluice_predictor_redis_fail_open_total") == 0
        keys = subprocess.run(
            ["redis-cli", "-p", str(stack.ports["redis", 6379]), "dbsize"], capture_output=True, text=True
        )
        assert int(keys.stdout.strip()) > 0, "the predictor wrote to Redis"

        # the same through the gateway's OpenAI API, as a client outside would reach it
        gateway = stack.address("gateway", int(stack.envs["gateway"]["SLUICE_PORT"]))
        http_out = tmp_path / "bench-http.json"
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "bench", "--backend", "openai", "--base-url",
            f"http://{gateway}/v1", "--trace", "azure-conv", "--rate", "4", "--num-requests", str(NUM_REQUESTS),
            "--max-tokens", "16", "--json", str(http_out), "--no-progress", cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(bench.communicate(), timeout=240)
        assert bench.returncode == 0, output.decode()[-3000:]
        metrics = json.loads(http_out.read_text())["metrics"]
        assert metrics["num_requests"] == NUM_REQUESTS and metrics["num_finished"] == NUM_REQUESTS, metrics

        assert metric_sum(scrape(gateway), "sluice_gateway_requests_total") == NUM_REQUESTS
        scheduler_page = scrape(stack.address("scheduler", 9400))
        assert metric_sum(scheduler_page, "sluice_request_success_total") == 2 * NUM_REQUESTS
    finally:
        # in a thread: the services flush their last spans as they exit, and the receiver
        # answering them runs on this event loop, which a blocking wait would stall
        await asyncio.to_thread(stack.stop)
        if receiver is not None:
            # spans are exported in batches and flushed when each service exits
            await receiver.stop(grace=1.0)
    assert {"sluice-scheduler", "sluice-worker", "sluice-predictor", "sluice-gateway"} <= spans_from, spans_from
