"""`sharegpt-multiturn`: every ShareGPT turn as a request whose prompt is the conversation so
far in real token ids, so the next turn's prompt starts with this turn's prompt and answer;
sessions interleave; and the simulator's prefix caching finds nearly all of that shared prefix."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, simulate
from scheduler_service.workloads import apply_arrivals, load_trace
from scheduler_service.workloads.multiturn import NUM_SESSIONS
from sluice.common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def trace():
    """The bundled 300 whole conversations (the full set's first 300: the same turns)."""
    return load_trace("sharegpt-multiturn-300", num_requests=400)


def test_each_turns_prompt_is_the_previous_turns_prompt_and_answer_then_the_new_question(trace) -> None:
    by_conversation = defaultdict(list)
    for r in trace.requests:
        conv, _, turn = r.request_id.rpartition("#t")
        by_conversation[conv].append((int(turn), r))
    followed = 0
    for turns in by_conversation.values():
        assert [t for t, _ in turns] == list(range(1, len(turns) + 1))  # turns keep their order
        for (_, a), (_, b) in pairwise(turns):
            context = (*a.prompt_token_ids, *a.output_token_ids)
            assert b.prompt_token_ids[: len(context)] == context and b.prompt_tokens > len(context)
            followed += 1
    assert followed > 100
    assert len(by_conversation) > NUM_SESSIONS  # conversations finish and new ones take their slots


def test_ids_are_the_real_tokenizers_and_the_text_matches_them(trace) -> None:
    tok = Tokenizer.demo()
    first = trace.requests[0]
    assert first.prompt_tokens == len(first.prompt_token_ids) and first.output_tokens == len(first.output_token_ids)
    assert all(0 <= t < tok.vocab_size for t in first.prompt_token_ids)
    words = tok.decode(first.prompt_token_ids).split()
    assert words[:2] == ["user", ":"] and "assistant" in words
    assert 0.6 < trace.metadata["prefix_share"] < 0.95


def test_sessions_interleave_so_a_users_next_turn_comes_later(trace) -> None:
    position = {r.request_id: i for i, r in enumerate(trace.requests)}
    gaps = []
    for r in trace.requests:
        conv, _, turn = r.request_id.rpartition("#t")
        if turn != "1":
            gaps.append(position[r.request_id] - position[f"{conv}#t{int(turn) - 1}"])
    assert min(gaps) >= 1 and sum(gaps) / len(gaps) > NUM_SESSIONS / 4


def test_vllm_with_prefix_caching_skips_most_of_the_shared_prefix(trace) -> None:
    cm = build_cost_model("analytic", "llama-3.1-8b", "h100-80g")
    workload = apply_arrivals(trace, "poisson", rate=2.0, seed=0)
    on = simulate(SimConfig(policy="vllm"), workload, cm).details
    off = simulate(SimConfig(policy="vllm", prefix_caching=False), workload, cm).details
    share = trace.metadata["prefix_share"]
    assert on["prefix_cache"]["hit_rate"] > 0.9 * share
    assert on["prefill_tokens"] < (1 - 0.9 * share) * off["prefill_tokens"]
    assert off["prefix_cache"]["hit_tokens"] == 0
