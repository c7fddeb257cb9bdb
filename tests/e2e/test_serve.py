"""The whole stack as processes: `sluice serve` starts, prints where it listens (gRPC, and the
OpenAI HTTP API it serves from its own process), serves both and shuts down on SIGINT leaving no worker
behind (with the worker and the predictor pinned to CPUs of their own where there are 2); with the
vllm engine and no CPU list, every thread of the worker runs on the cores the automatic placement
gave it and every thread of the scheduler on the rest (on every CPU with --no-auto-pin); and a
worker process killed with SIGKILL mid-run leaves every admitted request finished on the other
worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import sys
from pathlib import Path

import grpc
import openai
import pytest

from scheduler_service.live.config import LiveConfig
from services.serve import ServeConfig, add_serve_arguments, start_scheduler, start_workers, stop_workers
from sluice.common.config import config_from
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow


def _request(i: int, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=f"q{i}",
        token_ids=common_pb2.TokenIds(ids=list(range(2000 + i, 2030 + i))),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def _collect(stub: generation_pb2_grpc.GenerationServiceStub, i: int, n: int) -> list[int]:
    return [t async for m in stub.Generate(_request(i, n)) for t in m.token_ids]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> dict[int, str]:
    """The child processes of `pid` and their command lines (Linux /proc)."""
    out: dict[int, str] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    out[child] = c.read().replace(b"\0", b" ").decode()
    return out


def _pinning() -> tuple[list[str], dict[str, set[int]]]:
    """Flags that put the worker and the predictor on different CPUs, and which each should get;
    none where this process has fewer than 2 CPUs or the OS cannot pin."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return [], {}
    a, b = sorted(os.sched_getaffinity(0))[:2]
    return ["--worker-cpus", str(a), "--predictor-cpus", str(b)], {" worker ": {a}, " predictor serve ": {b}}


async def _stop_with_sigint(proc: asyncio.subprocess.Process) -> None:
    """`sluice serve`/`scheduler` stop on SIGINT and exit 0 (workers and children with them)."""
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), timeout=60) == 0


async def _kill_if_running(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def _stderr_after_exit(proc: asyncio.subprocess.Process, timeout_s: float = 30.0) -> str:
    """What the process wrote to stderr, once it exited (killed when it outlives `timeout_s`):
    the reason a line it should have printed is missing."""
    assert proc.stderr is not None
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    return (await proc.stderr.read()).decode(errors="replace")


async def test_sluice_serve_listens_serves_and_stops_cleanly_on_sigint() -> None:
    pin_flags, pinned = _pinning()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--workers", "1", "--port", "0", "--num-gpu-blocks", "64"]
    cmd += [*pin_flags, "--http-port", "0"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = ""
        while "listening on" not in line:
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout=120)).decode()
            if not line:
                pytest.fail(f"sluice serve exited before listening; its stderr:\n{await _stderr_after_exit(proc)}")
        match = re.search(r"listening on ([\d.]+):(\d+) .*workers ([\d.:]+)\)", line)
        assert match, line
        api = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        base_url = re.search(r"OpenAI API at (http://[\d.]+:\d+/v1)", api)
        if not base_url:
            pytest.fail(f"no OpenAI API line but {api!r}; sluice serve's stderr:\n{await _stderr_after_exit(proc)}")
        chat = await openai.AsyncOpenAI(base_url=base_url.group(1), api_key="none").chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 4
        async with grpc.aio.insecure_channel(f"{match.group(1)}:{match.group(2)}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            tokens = await asyncio.gather(*(_collect(stub, i, 8) for i in range(4)))
            info = await stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
        assert [len(t) for t in tokens] == [8] * 4
        assert [w.address for w in info.workers] == [match.group(3)]
        # the worker and the predictor, started with the flags, run on the CPUs they name
        children = _children(proc.pid)
        assert not any(" gateway " in line for line in children.values()), "HTTP is served in-process"
        assert "(model tiny-llama, this process)" in api, api
        for role, cpus in pinned.items():
            pids = [pid for pid, line in children.items() if role in line]
            assert len(pids) == 1, (role, children)
            assert os.sched_getaffinity(pids[0]) == cpus, role
        await _stop_with_sigint(proc)
        rest = (await proc.stdout.read()).decode()
        assert "shutting down" in rest
    finally:
        await _kill_if_running(proc)


def _threads_cpus(pid: int) -> dict[int, str]:
    """Each thread of `pid` and the CPUs it may run on, as the kernel lists them (Linux /proc)."""
    out: dict[int, str] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        # NOTE: a thread that ended since the listing has no status left
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/status") as f:
            out[int(task)] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("Cpus_allowed_list:"))
    return out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to place"
)
@pytest.mark.parametrize("auto_pin", [True, False])
async def test_sluice_serve_runs_a_vllm_engine_worker_on_cores_of_its_own(auto_pin: bool) -> None:
    from services.affinity import format_cpus
    from services.placement import auto_placement

    every = sorted(os.sched_getaffinity(0))
    expected = auto_placement(every, workers=1, engine="vllm", helpers=1)
    assert expected.placed
    cmd = [sys.executable, "-m", "services.cli", "serve", "--engine", "vllm", "--workers", "1", "--port", "0"]
    cmd += ["--num-gpu-blocks", "64", "--no-vllm-compile", "--no-start-predictor"]
    cmd += [] if auto_pin else ["--no-auto-pin"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        while "listening on" not in (lines or [""])[-1]:
            lines.append((await asyncio.wait_for(proc.stdout.readline(), timeout=300)).decode())
            if not lines[-1]:
                pytest.fail(f"sluice serve exited before listening; its stderr:\n{await _stderr_after_exit(proc)}")
        said = [line for line in lines if line.startswith("CPU placement (automatic")]
        assert said == (
            [f"CPU placement (automatic; --no-auto-pin turns it off): {expected.describe()}\n"] if auto_pin else []
        )
        match = re.search(r"listening on ([\d.]+):(\d+)", lines[-1])
        assert match, lines[-1]
        async with grpc.aio.insecure_channel(f"{match.group(1)}:{match.group(2)}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            tokens = await asyncio.gather(*(_collect(stub, i, 8) for i in range(4)))
        assert [len(t) for t in tokens] == [8] * 4
        workers = [pid for pid, line in _children(proc.pid).items() if " worker " in line]
        assert len(workers) == 1, _children(proc.pid)
        # every thread of the worker (vLLM's and gRPC's included) and of the scheduler process,
        # after serving: the model runner has its cores, the scheduler the rest
        worker_cpus = format_cpus(expected.workers[0]) if auto_pin else format_cpus(set(every))
        scheduler_cpus = format_cpus(expected.others) if auto_pin else format_cpus(set(every))
        assert set(_threads_cpus(workers[0]).values()) == {worker_cpus}
        assert set(_threads_cpus(proc.pid).values()) == {scheduler_cpus}
        await _stop_with_sigint(proc)
    finally:
        await _kill_if_running(proc)


async def test_a_killed_worker_process_leaves_every_admitted_request_finished_on_the_other() -> None:
    cfg = ServeConfig(workers=2, port=0, num_gpu_blocks=128, worker_threads=1)
    workers = await start_workers(cfg)
    try:
        server = await start_scheduler(cfg, [w.address for w in workers])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                tasks = [asyncio.ensure_future(_collect(stub, i, 48)) for i in range(12)]
                while server.live.loops[0].num_steps < 5:
                    await asyncio.sleep(0.005)
                workers[0].proc.kill()
                results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
                info = await stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
                stats = await stub.GetStats(generation_pb2.GetStatsRequest())
        finally:
            await server.stop(grace_s=1.0, drain_s=0.0)
    finally:
        await stop_workers(workers)
    assert [len(r) for r in results] == [48] * 12, "every admitted request finished with all its tokens"
    assert [w.healthy for w in info.workers] == [False, True]
    assert stats.num_finished == 12 and sum(w.gpu_blocks_used for w in stats.workers) == 0
    assert not any(_alive(w.proc.pid) for w in workers)


def _serve_settings(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfig:
    """What `sluice serve ARGV` would run with, under `environ`."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, workers=True)
    args = parser.parse_args(argv)
    return config_from(ServeConfig, args, file=args.config, environ=environ or {}, exclude=("worker",))


def test_settings_come_from_defaults_then_the_config_file_then_the_environment_then_the_flags(tmp_path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text('workers = 3\npolicy = "sarathi:budget=256"\nmax-waiting = 64\nrouter = "least_work"\n')
    cfg = _serve_settings(["--config", str(toml), "--policy", "vllm"], {"SLUICE_MAX_WAITING": "32", "SLUICE_PORT": "0"})
    assert (cfg.workers, cfg.policy, cfg.max_waiting, cfg.port, cfg.router) == (3, "vllm", 32, 0, "least_work")
    assert cfg.max_num_seqs == LiveConfig().max_num_seqs, "serve shares the live scheduler's defaults"
    js = tmp_path / "serve.json"
    js.write_text('{"model": "tiny-opt", "num_gpu_blocks": 32}')
    cfg = _serve_settings(["--config", str(js), "--no-int8-swap", "--max-num-batched-tokens", "none"])
    assert (cfg.model, cfg.num_gpu_blocks, cfg.int8_swap, cfg.max_num_batched_tokens) == ("tiny-opt", 32, False, None)
    js.write_text('{"wokers": 2}')
    with pytest.raises(ValueError, match="wokers"):
        _serve_settings(["--config", str(js)])
    with pytest.raises(ValueError, match="SLUICE_MAX_WAITING: not an integer"):
        _serve_settings([], {"SLUICE_MAX_WAITING": "lots"})


async def test_sluice_scheduler_serves_the_openai_api_from_its_own_process(tmp_path: Path) -> None:
    """`sluice scheduler --http-port 0`: the HTTP line, then the gRPC one; a completion over HTTP
    and the same request over gRPC give the same tokens (the echo engine's depend on position
    only); the request made over HTTP is the API key's, so a gRPC client with that key may
    abort it; bad input over HTTP is a 400 naming the field and the scheduler keeps serving."""
    from sluice_bench.live import spawn_worker

    worker = spawn_worker(engine="echo", log_dir=tmp_path, extra=("--echo-step-ms", "5"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["SLUICE_API_KEY"] = "sk-e2e"
    cmd = [sys.executable, "-m", "services.cli", "scheduler", "--worker", worker.address, "--port", "0"]
    cmd += ["--http-port", "0", "--num-gpu-blocks", "256"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    try:
        api = (await asyncio.wait_for(proc.stdout.readline(), timeout=120)).decode()
        base_url = re.search(r"OpenAI API at (http://[\d.]+:\d+/v1) \(this process\)", api)
        if not base_url:
            pytest.fail(f"no OpenAI API line but {api!r}; stderr:\n{await _stderr_after_exit(proc)}")
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        grpc_port = re.search(r"listening on [\d.]+:(\d+) ", line)
        assert grpc_port, line
        client = openai.AsyncOpenAI(base_url=base_url.group(1), api_key="sk-e2e", max_retries=0)
        whole = await client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=6)
        assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 6)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, top_p=5.0)
        assert bad.value.body["param"] == "top_p"
        metadata = (("authorization", "Bearer sk-e2e"),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port.group(1)}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=6),
            )
            texts = [m.text async for m in stub.Generate(request, metadata=metadata)]
            assert "".join(texts) == whole.choices[0].text, "both APIs run the same request alike"
            stream = await client.completions.create(
                model="tiny-llama",
                prompt="x",
                max_tokens=1500,
                stream=True,
                extra_body={"request_id": "http-owned", "ignore_eos": True},
            )
            first = await anext(aiter(stream))
            assert first.choices[0].text is not None
            answer = await stub.Abort(generation_pb2.AbortRequest(request_ids=["http-owned"]), metadata=metadata)
            assert list(answer.aborted_ids) == ["http-owned"], "the key's own request, made over HTTP"
            reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
            assert reasons and reasons[-1] == "abort", reasons
        await _stop_with_sigint(proc)
    finally:
        await _kill_if_running(proc)
        worker.stop()
