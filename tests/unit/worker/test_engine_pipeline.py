"""The engine's pipeline (LLMEngine.launch / collect): step N+1 launched before step N's tokens
are collected, its inputs taking N's tokens by reference, gives the tokens of one step at a
time, with greedy, seeded and penalised sampling, and a request released and sent again while
its step is still uncollected. On CUDA (marked gpu) with and without decode graphs, where the
reference is a device-side write into the next step's (graph) input."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sluice.contract.sampling import SamplingParams
from tests.unit.worker.worker_harness import MiniScheduler, make_engine, random_prompt
from worker_service.engine import Launched, LLMEngine, StepPlanError

Preempt = Callable[[MiniScheduler, int], set[str]]
PLACEHOLDER = -1
SAMPLING = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=64),
    "seeded": SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=64),
    "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=64),
}
STEPS = 10


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [
    pytest.param(("cpu", False), id="cpu"),
    pytest.param(("cuda", True), id="cuda-graphs", marks=ON_CUDA),
    pytest.param(("cuda", False), id="cuda-eager", marks=ON_CUDA),
]


def engine(device: tuple[str, bool] = ("cpu", False)) -> LLMEngine:
    torch.set_num_threads(1)
    name, graphs = device
    if name == "cpu":
        return make_engine("tiny-llama", num_gpu_blocks=128)
    return make_engine("tiny-llama", num_gpu_blocks=128, device=name, cuda_graphs=graphs)


def mini(eng: LLMEngine, names: tuple[str, ...]) -> MiniScheduler:
    sched = MiniScheduler(eng)
    for i, name in enumerate(names):
        sched.add(name, random_prompt(9 + 5 * i, seed=i), SAMPLING[name])
    return sched


def schedule_all(sched: MiniScheduler) -> dict[str, int]:
    return {rid: sched.remaining_prefill(rid) for rid in sched.tokens}


def one_at_a_time(
    names: tuple[str, ...], preempt: Preempt | None = None, device: tuple[str, bool] = ("cpu", False)
) -> MiniScheduler:
    sched = mini(engine(device), names)
    for step in range(STEPS):
        sched.step(schedule_all(sched))
        if preempt is not None:
            preempt(sched, step)
    return sched


def pipelined(
    names: tuple[str, ...], preempt: Preempt | None = None, device: tuple[str, bool] = ("cpu", False)
) -> MiniScheduler:
    """Plans step N+1 on counts alone (a placeholder for each token N samples) and launches it
    before collecting N, as the worker's pipeline does."""
    eng = engine(device)
    sched = mini(eng, names)
    in_flight: tuple[Launched, set[str]] | None = None  # the uncollected step, requests voided in it
    for step in range(STEPS):
        plan = sched.build(schedule_all(sched))
        launched = eng.launch(plan)
        sched.releases, sched.moves, sched.resumed = [], [], set()
        sched.step_id += 1
        for rid, n in plan.num_scheduled_tokens.items():
            sched.on_worker.add(rid)
            sched.computed[rid] += n
        for rid in plan.sample_ids:
            sched.tokens[rid].append(PLACEHOLDER)
        if in_flight is not None:
            fill(sched, eng.collect(in_flight[0]).sampled_token_ids, in_flight[1])
        in_flight = (launched, preempt(sched, step) if preempt is not None else set())
    assert in_flight is not None
    fill(sched, eng.collect(in_flight[0]).sampled_token_ids, in_flight[1])
    assert not eng._uncollected, "every token launched came back"
    for rid, state in eng.requests.items():
        assert state.token_ids == sched.tokens[rid], f"the engine's history of {rid} holds every token, in order"
        assert not state.pending
    return sched


def fill(sched: MiniScheduler, sampled: dict[str, int], voided: set[str]) -> None:
    for rid, token in sampled.items():
        if rid not in voided:
            tokens = sched.tokens[rid]
            tokens[tokens.index(PLACEHOLDER)] = token


@pytest.mark.parametrize("device", DEVICES)
def test_launching_ahead_gives_the_tokens_of_one_step_at_a_time(device: tuple[str, bool]) -> None:
    names = tuple(SAMPLING)
    base, ahead = one_at_a_time(names, device=device), pipelined(names, device=device)
    for rid in names:
        assert len(base.outputs(rid)) == STEPS
        assert ahead.outputs(rid) == base.outputs(rid), rid


def preempt_greedy_at_step_4(sched: MiniScheduler, step: int) -> set[str]:
    """Recompute preemption: the request is released and sent again with its known tokens; a
    token of it still uncollected is voided (as the scheduler's overlap does)."""
    if step != 4:
        return set()
    tokens = sched.tokens["greedy"]
    if tokens[-1] == PLACEHOLDER:
        tokens.pop()
    sched.preempt_recompute("greedy")
    return {"greedy"}


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_released_and_sent_again_while_its_step_is_uncollected_keeps_its_tokens(
    device: tuple[str, bool],
) -> None:
    names = ("greedy", "penalised")
    base, ahead = one_at_a_time(names, device=device), pipelined(names, preempt_greedy_at_step_4, device)
    assert ahead.outputs("penalised") == base.outputs("penalised")
    # greedy: the voided token is computed again after the restart, so the same tokens come
    out = ahead.outputs("greedy")
    assert PLACEHOLDER not in out
    assert out == base.outputs("greedy")[: len(out)] and len(out) >= STEPS - 2


def test_uncollected_tokens_count_as_known_and_no_further() -> None:
    """With a step launched and not collected, the next decode (its input the uncollected token)
    is accepted; a plan reaching past that token is refused before anything changes."""
    eng = engine()
    sched = mini(eng, ("greedy",))
    first = sched.build(schedule_all(sched))
    eng.launch(first)
    prompt = len(sched.tokens["greedy"])
    sched.releases, sched.step_id = [], 1
    sched.on_worker.add("greedy")
    sched.computed["greedy"] = prompt
    sched.tokens["greedy"].extend([PLACEHOLDER, PLACEHOLDER])  # a scheduler two tokens ahead
    state = eng.requests["greedy"]
    before = (list(state.token_ids), state.num_computed_tokens, len(state.pending))
    with pytest.raises(StepPlanError, match="are known"):
        eng.launch(sched.build({"greedy": 2}))
    assert (list(state.token_ids), state.num_computed_tokens, len(state.pending)) == before
    sched.tokens["greedy"].pop()
    second = eng.launch(sched.build({"greedy": 1}))
    assert len(state.pending) == 2, "two tokens on their way back"
    assert eng.collect(eng._uncollected[0]).sampled_token_ids.keys() == {"greedy"}
    assert eng.collect(second).sampled_token_ids.keys() == {"greedy"}
    assert len(state.token_ids) == prompt + 2 and not state.pending and not eng._uncollected
