"""The plug-in in vLLM's engine with a tiny Llama (dummy weights, local config, CPU): each
policy reorders the finish order of a crafted workload as designed, while every request's
tokens equal those of the FCFS run (the FCFS plug-in decides exactly as vLLM's own scheduler:
tests/unit/test_vllm_plugin_scheduler.py); aging ends the starvation of a long request.

One engine for the module (in-process, so the test can switch the policy between workloads on
the idle engine: `SluiceSchedulerMixin.use_policy`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from sluice_bench.vllm_plugin_harness import TINY_MODEL
from sluice_vllm.config import PluginConfig, parse_policy

pytestmark = pytest.mark.slow

LONG, SHORT = 48, 6  # output tokens


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (read at build)
    from vllm import LLM

    llm = LLM(
        model=TINY_MODEL,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        # NOTE: the KV size named, not a share of the node's memory less this process's RSS (which
        # the tests before this one grow)
        kv_cache_memory_bytes=256 * 2**20,
        block_size=32,
        max_model_len=2048,
        max_num_seqs=2,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        seed=0,
        scheduler_cls="sluice_vllm.scheduler.SluiceScheduler",
    )
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    yield llm.llm_engine
    del llm


def scheduler_of(engine: Any) -> Any:
    return engine.engine_core.engine_core.scheduler


def use(engine: Any, spec: str) -> Any:
    name, options = parse_policy(spec)
    s = scheduler_of(engine)
    s.use_policy(PluginConfig(policy=name, options=options))
    return s


def run(engine: Any, requests: list[dict[str, Any]], policy: str) -> tuple[list[str], dict[str, list[int]]]:
    """Adds every request at once, steps until all finished: (finish order, tokens by id)."""
    from vllm import SamplingParams

    use(engine, policy)
    for r in requests:
        params = SamplingParams(
            max_tokens=r["out"], temperature=0.0, ignore_eos=True, detokenize=False, extra_args=r.get("xargs")
        )
        prompt = {"prompt_token_ids": [3 + (i * 7 + r["seed"]) % 500 for i in range(r["prompt"])]}
        engine.add_request(r["id"], prompt, params, priority=r.get("priority", 0))
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return order, tokens


def workload() -> list[dict[str, Any]]:
    """Long answers arrive first, short ones after; two seats, so the short ones queue."""
    reqs = []
    for i in range(3):
        reqs.append({"id": f"long{i}", "prompt": 200, "out": LONG, "seed": i, "priority": 1})
    for i in range(3):
        reqs.append({"id": f"short{i}", "prompt": 40, "out": SHORT, "seed": 10 + i, "priority": 0})
    for r in reqs:
        short = r["id"].startswith("short")
        r["xargs"] = {"predicted_tokens": r["out"], "ttft_ms": 200 if short else 20000}
        if not short:
            r["xargs"]["slo_class"] = "offline"
    return reqs


def mean_rank(order: list[str], prefix: str) -> float:
    ranks = [i for i, rid in enumerate(order) if rid.startswith(prefix)]
    return sum(ranks) / len(ranks)


@pytest.fixture(scope="module")
def fcfs_run(engine: Any) -> tuple[list[str], dict[str, list[int]]]:
    return run(engine, workload(), "fcfs")


def test_fcfs_serves_in_arrival_order(fcfs_run: tuple[list[str], dict[str, list[int]]]) -> None:
    order, tokens = fcfs_run
    assert order[:2] == ["long0", "long1"]
    assert mean_rank(order, "short") > mean_rank(order, "long")  # short answers wait behind long ones
    assert all(len(tokens[f"long{i}"]) == LONG for i in range(3))


@pytest.mark.parametrize("policy", ["alise", "priority", "accelgen", "slo_class", "fastserve:step_base_ms=1"])
def test_policy_puts_short_answers_first_with_identical_tokens(
    engine: Any, fcfs_run: tuple[list[str], dict[str, list[int]]], policy: str
) -> None:
    """alise: predicted remaining; priority: the short ones' priority 0; accelgen: their tight
    TTFT; slo_class: the long ones are offline; fastserve: skip-join puts the 200-token prompts
    in a lower queue than the 40-token ones."""
    base_order, base_tokens = fcfs_run
    order, tokens = run(engine, workload(), policy)
    assert mean_rank(order, "short") < mean_rank(order, "long"), order
    assert mean_rank(order, "short") < mean_rank(base_order, "short")
    assert tokens == base_tokens  # scheduling moved when each request ran, never what it generated


def test_sarathi_caps_every_step_at_tau_with_identical_tokens(
    engine: Any, fcfs_run: tuple[list[str], dict[str, list[int]]]
) -> None:
    s = scheduler_of(engine)
    sizes: list[int] = []
    original = type(s).schedule

    def recording(self: Any, *a: Any, **kw: Any) -> Any:
        out = original(self, *a, **kw)
        sizes.append(out.total_num_scheduled_tokens)
        return out

    s.schedule = recording.__get__(s)
    try:
        _, tokens = run(engine, workload(), "sarathi:budget=64")
    finally:
        del s.schedule
    assert max(sizes) == 64  # the 200-token prompts go in chunks of tau
    assert tokens == fcfs_run[1]


def test_aging_ends_the_starvation_of_a_long_request(engine: Any) -> None:
    """One seat (ALISE's job limit M = 1); a long request waits while short ones keep coming,
    a new one whenever the last was admitted, so one short request, ranked ahead of the long
    one, is always waiting when the seat frees. Without aging the long request is still
    waiting when the stream ends; with aging it reaches queue 0 and runs."""
    import time

    from vllm import SamplingParams

    def params(n: int, predicted: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=n, ignore_eos=True, detokenize=False, extra_args={"predicted_tokens": predicted}
        )

    def stream(policy: str, seconds: float = 1.5) -> bool:
        """Whether the long request started within `seconds` of short arrivals."""
        s = use(engine, policy)
        engine.add_request("long", {"prompt_token_ids": [5] * 40}, params(8, 500))
        long_id = next(k for k in s.requests if k.startswith("long"))
        started = False
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end and not started:
            if not any(r.request_id.startswith("s") for r in s.waiting):
                engine.add_request(f"s{n}", {"prompt_token_ids": [6] * 40}, params(3, 3))
                n += 1
            engine.step()
            req = s.requests.get(long_id)
            started = req is None or req.num_computed_tokens > 0
        while engine.has_unfinished_requests():
            engine.step()
        assert n > 5, "the stream must have run"
        return started

    assert not stream("alise:job_limit=1,aging_s=1000")  # starved for the whole stream
    assert stream("alise:job_limit=1,aging_s=0.1")
