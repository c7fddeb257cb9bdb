"""Sampler: greedy, per-request seeds reproducible whatever the batch, top-k / top-p /
min-p masks, min_tokens masking EOS, penalties; and seeded sampling through the engine."""

from __future__ import annotations

import torch
from worker_harness import MiniScheduler, make_engine, random_prompt

from sluice.contract.sampling import SamplingParams
from worker_service.sampler import Sampler, SamplingRow, mask_min_p, mask_top_k_top_p

VOCAB = 50
EOS = 7


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def row(sampler: Sampler, seed: int | None = None, **params: object) -> SamplingRow:
    gen = None if seed is None else sampler.make_generator(seed)
    return SamplingRow(SamplingParams(seed=seed, **params), [1, 2, 3], 0, gen)  # type: ignore[arg-type]


def test_greedy_takes_the_argmax() -> None:
    sampler, logits = Sampler((EOS,), torch.device("cpu")), logits_batch(3)
    assert sampler(logits, [row(sampler, temperature=0.0) for _ in range(3)]) == logits.argmax(-1).tolist()


def test_seeded_row_is_reproducible_regardless_of_batch_composition() -> None:
    def draws(batch: int, position: int) -> list[int]:
        sampler = Sampler((EOS,), torch.device("cpu"), seed=batch)
        target = row(sampler, seed=1234, temperature=1.0)
        out = []
        for step in range(20):
            logits = logits_batch(batch, seed=step)
            logits[position] = logits_batch(1, seed=1000 + step)[0]
            rows = [row(sampler, temperature=0.8) for _ in range(batch)]
            rows[position] = target
            out.append(sampler(logits, rows)[position])
        return out

    alone = draws(1, 0)
    assert draws(4, 2) == alone
    assert draws(7, 6) == alone
    assert len(set(alone)) > 3  # it really samples


def test_top_k_keeps_exactly_k_best() -> None:
    logits = logits_batch(2)
    masked = mask_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([1.0, 1.0]))
    kept = torch.isfinite(masked)
    assert kept[0].sum() == 3 and set(kept[0].nonzero().flatten().tolist()) == set(logits[0].topk(3).indices.tolist())
    assert bool(kept[1].all())
    assert torch.equal(masked[kept], logits[kept])


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    masked = mask_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([0.8, 0.81]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False], [True, True, True, False]]


def test_top_p_always_keeps_the_best_token() -> None:
    logits = torch.log(torch.tensor([[0.9, 0.1]]))
    assert torch.isfinite(mask_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))).tolist() == [[True, False]]


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(mask_min_p(logits, torch.tensor([0.35]))).tolist() == [[True, True, False, False]]


def test_sampled_tokens_stay_inside_the_top_k() -> None:
    sampler, logits = Sampler((EOS,), torch.device("cpu")), logits_batch(1)
    allowed = set(logits[0].topk(4).indices.tolist())
    for _ in range(50):
        assert sampler(logits.clone(), [row(sampler, temperature=2.0, top_k=4)])[0] in allowed


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    sampler = Sampler((EOS,), torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 9], logits[0, 11] = 10.0, 9.0, 8.0
    params = {"temperature": 0.0, "min_tokens": 2, "stop_token_ids": (9,)}
    early = SamplingRow(SamplingParams(**params), [1, 2, 3], 1)  # type: ignore[arg-type]
    done = SamplingRow(SamplingParams(**params), [1, 2, 3], 2)  # type: ignore[arg-type]
    assert sampler(logits.clone(), [early]) == [11]
    assert sampler(logits.clone(), [done]) == [EOS]


def test_penalties_push_away_from_repeated_tokens() -> None:
    sampler = Sampler((EOS,), torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.9
    repeated = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.5), [3, 3], 2)
    assert sampler(logits.clone(), [repeated]) == [4]
    rep = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5), [3], 0)
    assert sampler(logits.clone(), [rep]) == [4]  # 2.0 / 1.5 < 1.9, prompt tokens count too


def test_engine_seeded_request_repeats_its_tokens_in_a_different_batch() -> None:
    engine = make_engine("tiny-opt", num_gpu_blocks=32, num_cpu_blocks=0)
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=7)
    prompt = random_prompt(6, seed=5)

    def generate(companions: int) -> list[int]:
        engine.init_kv_cache(32, 0)
        sched = MiniScheduler(engine)
        sched.add("s", prompt, seeded)
        for i in range(companions):
            sched.add(f"c{i}", random_prompt(5 + i, seed=20 + i), SamplingParams(temperature=1.0))
        sched.step({rid: len(t) for rid, t in sched.tokens.items()})
        for _ in range(6):
            sched.step(dict.fromkeys(sched.tokens, 1))
        return sched.outputs("s")

    assert generate(0) == generate(3)
