"""The `vllm` engine: vLLM's model runner executing Sluice's plans gives vLLM's own tokens.

Checkpoints are written here (transformers, random weights widened so greedy decoding is not
degenerate; no download): a GQA Llama and an OPT, with the demo vocabulary. The reference is
vLLM's own `LLM.generate` over the same directory, prompts and sampling. Through the live
stack (an in-process scheduler and `sluice worker --engine vllm` processes, over real gRPC): greedy parity with the
`vllm` policy (fp32 and bf16), chunked prefill mixed with decodes (`sarathi`), preemption by
recompute and by swap under a small KV cache, cancel leaving no KV, a killed worker's
requests finishing on the other, and disaggregated prefill and decode moving KV between two
vLLM workers. Driving the engine with plans directly: a prefix-cache hit
and a swap out and in into other block ids change no token.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan
from sluice.contract.sampling import SamplingParams
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_service.engine_contract import EngineConfig
from worker_service.vllm_engine import VllmEngine

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on ([0-9.]+):(\d+)")

BLOCK = 32
VOCAB = 30522
MAX_LEN = 512
PROMPTS = [
    [(97 * i + 13 * j) % (VOCAB - 200) + 100 for j in range(n)] for i, n in enumerate([5, 37, 80, 12, 150, 64, 23, 101])
]
MAX_TOKENS = [12, 20, 8, 30, 16, 24, 10, 18]
JOBS = list(zip(PROMPTS, MAX_TOKENS, strict=True))
# Each grows from 2 blocks to 4 while 4 share a worker's 8 blocks: the policy must preempt.
TIGHT_JOBS = [([(31 * i + 7 * j) % 20000 + 300 for j in range(40)], 60) for i in range(8)]


def write_checkpoint(path: Path, family: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    if family == "llama":
        hf = LlamaForCausalLM(
            LlamaConfig(**small, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=MAX_LEN)
        )
    else:
        hf = OPTForCausalLM(OPTConfig(**small, ffn_dim=256, max_position_embeddings=MAX_LEN))
    with torch.no_grad():
        for p in hf.parameters():  # NOTE: std 0.02 init gives near-constant logits: widen it
            p.add_(torch.randn_like(p) * 0.05)
    hf.eval().save_pretrained(path, safe_serialization=True)
    return path


def vllm_reference(model: str, dtype: str, prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    """vLLM alone: LLM.generate, greedy, EOS ignored."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling

    # NOTE: the KV size named: otherwise vLLM-CPU gives the KV cache gpu_memory_utilization x the
    # node's memory less this process's RSS, and the reference would fail once the tests before it
    # have grown the test process past that share
    llm = LLM(
        model=model, dtype=dtype, skip_tokenizer_init=True, block_size=BLOCK, kv_cache_memory_bytes=64 * 2**20,
        num_gpu_blocks_override=128, max_model_len=MAX_LEN, enforce_eager=True, seed=0,
    )  # fmt: skip
    params = [VllmSampling(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    return [list(o.outputs[0].token_ids) for o in outs]


def vllm_engine(model: str, dtype: str) -> VllmEngine:
    return VllmEngine(EngineConfig(model=model, dtype=dtype, block_size=BLOCK, vllm_compile=False))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_checkpoint(root / f, f) for f in ("llama", "opt")}


@dataclass
class Worker:
    """A `sluice worker --engine vllm` process (vLLM keeps per-process state: one engine each)."""

    process: subprocess.Popen
    address: str

    async def held_requests(self) -> int:
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            reply = await worker_pb2_grpc.WorkerServiceStub(channel).Health(worker_pb2.HealthRequest())
        return reply.num_requests

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _listening(process: subprocess.Popen) -> str:
    assert process.stdout is not None
    for line in process.stdout:
        if match := LISTENING.search(line):
            process.stdout.close()
            return f"{match.group(1)}:{match.group(2)}"
    raise RuntimeError(f"the worker exited (code {process.wait()}) before listening")


async def start_workers(model: str, dtype: str, roles: Sequence[str] = ("mixed", "mixed")) -> list[Worker]:
    procs = []
    for i, role in enumerate(roles):
        cmd = [sys.executable, "-m", "services.cli", "worker", "--engine", "vllm", "--model", model, "--dtype", dtype]
        cmd += ["--block-size", str(BLOCK), "--no-vllm-compile", "--threads", "1", "--port", "0", "--worker-id", str(i)]
        cmd += ["--role", role]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        )
    addresses = await asyncio.gather(*(asyncio.to_thread(_listening, p) for p in procs))
    return [Worker(p, a) for p, a in zip(procs, addresses, strict=True)]


@asynccontextmanager
async def stack(addresses: Sequence[str], **config: object) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    cfg = LiveConfig(**{"num_gpu_blocks": 64, "swap_space_gib": 0.01, "connect_timeout_s": 120.0, **config})
    server = await SchedulerServer.start(LiveScheduler(addresses, cfg))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield generation_pb2_grpc.GenerationServiceStub(channel)
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)


async def generate(stub: generation_pb2_grpc.GenerationServiceStub, i: int, prompt: list[int], n: int) -> list[int]:
    request = generation_pb2.GenerateRequest(
        request_id=f"r{i}",
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    )
    return [t async for m in stub.Generate(request) for t in m.token_ids]


async def generate_all(
    stub: generation_pb2_grpc.GenerationServiceStub, jobs: Sequence[tuple[list[int], int]] = JOBS
) -> list[list[int]]:
    return list(await asyncio.gather(*(generate(stub, i, p, n) for i, (p, n) in enumerate(jobs))))


async def wait_idle(stub: generation_pb2_grpc.GenerationServiceStub, workers: Sequence[Worker]) -> None:
    for _ in range(500):
        stats = await stub.GetStats(generation_pb2.GetStatsRequest())
        used = sum(w.gpu_blocks_used + w.cpu_blocks_used for w in stats.workers if w.healthy)
        if used == 0 and stats.num_running == stats.num_waiting == 0:
            break
        await asyncio.sleep(0.02)
    assert used == 0, f"KV still owned: {stats}"
    assert [await w.held_requests() for w in workers] == [0] * len(workers)


# ---------------------------------------------------------------- through the stack


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "float32"), ("opt", "float32"), ("llama", "bfloat16"), ("opt", "bfloat16")]
)
async def test_stack_with_the_vllm_policy_gives_llm_generate_tokens(
    family: str, dtype: str, checkpoints: dict[str, Path]
) -> None:
    model = str(checkpoints[family])
    expected = vllm_reference(model, dtype, PROMPTS, MAX_TOKENS)
    workers = await start_workers(model, dtype)
    try:
        async with stack([w.address for w in workers], policy="vllm") as stub:
            got = await generate_all(stub)
            await wait_idle(stub, workers)
    finally:
        for w in workers:
            w.kill()
    assert got == expected


@pytest.fixture(scope="module")
async def llama_workers(checkpoints: dict[str, Path]) -> AsyncIterator[list[Worker]]:
    model = str(checkpoints["llama"])
    workers = await start_workers(model, "float32")
    yield workers
    for w in workers:
        w.kill()


@pytest.fixture(scope="module")
def llama_expected(checkpoints: dict[str, Path]) -> list[list[int]]:
    return vllm_reference(str(checkpoints["llama"]), "float32", PROMPTS, MAX_TOKENS)


async def test_chunked_prefill_beside_decodes_changes_no_token(
    llama_workers: list[Worker], llama_expected: list[list[int]]
) -> None:
    async with stack([w.address for w in llama_workers], policy="sarathi:budget=48") as stub:
        got = await generate_all(stub)  # prompts of up to 150 tokens in chunks of <= 48 beside decodes
        await wait_idle(stub, llama_workers)
    assert got == llama_expected


@pytest.fixture(scope="module")
def tight_expected(checkpoints: dict[str, Path]) -> list[list[int]]:
    prompts, max_tokens = zip(*TIGHT_JOBS, strict=True)
    return vllm_reference(str(checkpoints["llama"]), "float32", prompts, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_preemption_by_recompute_and_by_swap_changes_no_token(
    mode: str, llama_workers: list[Worker], tight_expected: list[list[int]]
) -> None:
    addresses = [w.address for w in llama_workers]
    async with stack(addresses, policy=f"vllm:preemption_mode={mode}", num_gpu_blocks=8) as stub:
        got = await generate_all(stub, TIGHT_JOBS)
        stats = await stub.GetStats(generation_pb2.GetStatsRequest())
        await wait_idle(stub, llama_workers)
    assert stats.num_preemptions > 0, "8 blocks a worker were meant to force preemptions"
    assert got == tight_expected


async def test_cancelled_streams_leave_no_kv_and_others_finish(
    llama_workers: list[Worker], llama_expected: list[list[int]]
) -> None:
    async with stack([w.address for w in llama_workers], policy="vllm") as stub:
        long = generation_pb2.GenerateRequest(
            request_id="cancel-me",
            token_ids=common_pb2.TokenIds(ids=PROMPTS[4]),
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
        )
        call = stub.Generate(long)
        first = await call.read()
        assert first.token_ids
        call.cancel()
        got = await generate(stub, 1, PROMPTS[1], MAX_TOKENS[1])
        await wait_idle(stub, llama_workers)
    assert got == llama_expected[1]


async def test_a_killed_workers_requests_finish_on_the_other(
    llama_workers: list[Worker], llama_expected: list[list[int]]
) -> None:
    """The last test of the shared workers: it kills one."""
    async with stack([w.address for w in llama_workers], policy="vllm") as stub:
        tasks = [asyncio.ensure_future(generate(stub, i, p, n)) for i, (p, n) in enumerate(JOBS)]
        while not await llama_workers[0].held_requests():
            await asyncio.sleep(0.01)
        llama_workers[0].kill()  # SIGKILL with requests in flight
        got = await asyncio.gather(*tasks)
        await wait_idle(stub, llama_workers[1:])
    assert got == llama_expected


async def test_disaggregated_prefill_and_decode_move_kv_between_vllm_workers(
    checkpoints: dict[str, Path], llama_expected: list[list[int]]
) -> None:
    """OfferKv / PullKv / ReadKv read and write vLLM's KV tensors: the decode worker continues
    from the prefill worker's KV, and every token is vLLM's own."""
    workers = await start_workers(str(checkpoints["llama"]), "float32", roles=("prefill", "decode"))
    cfg = LiveConfig(num_gpu_blocks=64, swap_space_gib=0.01, connect_timeout_s=120.0, policy="vllm")
    try:
        server = await SchedulerServer.start(LiveScheduler([w.address for w in workers], cfg))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                got = await generate_all(stub)
                await wait_idle(stub, workers)
            transfers = server.live.cluster.transfers
        finally:
            await server.stop(grace_s=1.0, drain_s=0.0)
    finally:
        for w in workers:
            w.kill()
    assert got == llama_expected
    assert transfers.succeeded == len(JOBS) and transfers.failed == transfers.recomputed == 0, transfers.summary()


# ---------------------------------------------------------------- plans straight into the engine


class Driver:
    """Plans by hand: each request decodes `n` tokens greedily in its own blocks."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.step = 0

    def run(self, scheduled: dict[str, int], new: Sequence[NewRequestData] = (), **kw: object) -> dict[str, int]:
        self.step += 1
        plan = StepPlan(self.step, 0, tuple(new), kw.pop("cached", CachedRequestData()), scheduled,
                        frozenset(kw.pop("sample", scheduled)), **kw)  # fmt: skip
        result = self.engine.execute(plan)
        assert result.error is None
        return dict(result.sampled_token_ids)


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def alone(engine: VllmEngine, prompt: list[int], n: int, blocks: tuple[int, ...]) -> list[int]:
    d, out = Driver(engine), []
    out.append(d.run({"ref": len(prompt)}, [NewRequestData("ref", tuple(prompt), len(prompt), GREEDY, blocks)])["ref"])
    while len(out) < n:
        out.append(d.run({"ref": 1})["ref"])
    engine.release(["ref"])
    return out


@pytest.fixture(scope="module")
def engine(checkpoints: dict[str, Path]) -> VllmEngine:
    eng = vllm_engine(str(checkpoints["llama"]), "float32")
    eng.init_kv_cache(32, 8)
    return eng


def test_a_prefix_cache_hit_computes_only_the_suffix_and_changes_no_token(engine: VllmEngine) -> None:
    shared = PROMPTS[4][:128]  # four full blocks
    prompt_b = [*shared, 7, 8, 9]
    expected = alone(engine, prompt_b, 6, (10, 11, 12, 13, 14))
    d = Driver(engine)
    d.run({"a": 128}, [NewRequestData("a", tuple(shared), 128, GREEDY, (0, 1, 2, 3))], sample=())
    # b holds a's four computed blocks read-only and computes its last three tokens only
    b = NewRequestData("b", tuple(prompt_b), len(prompt_b), GREEDY, (0, 1, 2, 3, 4), num_computed_tokens=128)
    out = [d.run({"b": 3}, [b])["b"]]
    while len(out) < 6:
        out.append(d.run({"b": 1})["b"])
    assert engine.release(["a", "b"]) == ["a", "b"]
    assert out == expected
    assert engine.num_requests == 0


@pytest.mark.parametrize("int8", [False, True])
def test_swap_out_and_in_to_other_blocks_continues_the_same_tokens(engine: VllmEngine, int8: bool) -> None:
    prompt = PROMPTS[2]  # 80 tokens: three blocks
    expected = alone(engine, prompt, 8, (20, 21, 22))
    d = Driver(engine)
    out = [d.run({"s": 80}, [NewRequestData("s", tuple(prompt), 80, GREEDY, (0, 1, 2))])["s"]]
    out.append(d.run({"s": 1})["s"])
    out_move = KVMove(KVMoveKind.SWAP_OUT, "s", (0, 1, 2), (5, 6, 7), int8=int8)
    d.run({}, kv_moves=(out_move,))
    engine.cache.zero()  # NOTE: the GPU blocks are gone; only the swapped copy can bring the KV back
    back = CachedRequestData(("s",), ((9, 10, 11),), (True,), (81,))
    d.run({}, kv_moves=(KVMove(KVMoveKind.SWAP_IN, "s", (5, 6, 7), (9, 10, 11)),), cached=back)
    while len(out) < 8:
        out.append(d.run({"s": 1})["s"])
    engine.release(["s"])
    if int8:  # quantized KV: the first tokens after the swap may differ by rounding; most match
        assert sum(a == b for a, b in zip(out, expected, strict=False)) >= 6
    else:
        assert out == expected


def test_kv_blocks_travel_bit_exact_through_export_and_import(engine: VllmEngine) -> None:
    d = Driver(engine)
    d.run({"t": 64}, [NewRequestData("t", tuple(PROMPTS[5]), 64, GREEDY, (0, 1))])
    cache = engine.cache
    data = cache.export_blocks([0, 1], False)
    before = cache._gather_gpu([0, 1]).clone()
    cache.import_blocks([15, 16], torch.frombuffer(bytearray(data), dtype=torch.uint8).view(2, -1), False)
    assert torch.equal(cache._gather_gpu([15, 16]), before)
    assert len(data) == 2 * cache.transfer_bytes_per_block(False) == 2 * engine.info.bytes_per_block
    engine.release(["t"])
