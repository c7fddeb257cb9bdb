"""Blending the head with retrieved neighbours; the retrieval history; the circuit breaker; the memory cache."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from predictor_service.blend import BlendConfig, blend, to_tokens
from predictor_service.cache import MemoryCache, cache_key
from predictor_service.redis_guard import CircuitBreaker
from predictor_service.retrieval import HNSW_MIN, History, Neighbours
from sluice.contract.length_prediction import LengthPrediction

LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9)
HEAD = np.log1p(np.array([[50.0, 80.0, 120.0, 200.0, 300.0]]))


def neighbours(sims: list[float], lengths: list[int], k: int = 4) -> Neighbours:
    s = np.full((1, k), -np.inf, dtype=np.float32)
    v = np.zeros((1, k), dtype=np.float32)
    s[0, : len(sims)], v[0, : len(lengths)] = sims, np.log1p(lengths)
    return Neighbours(s, v)


def test_without_neighbours_the_head_answers_alone() -> None:
    out, alpha = blend(HEAD, neighbours([], []), BlendConfig(k=4), LEVELS)
    assert alpha[0] == 0.0
    np.testing.assert_allclose(out, HEAD)


def test_an_exact_repeat_pulls_the_prediction_to_its_observed_length() -> None:
    cfg = BlendConfig(k=4, threshold=0.8, temperature=0.05, kappa=0.5, bandwidth=0.2)
    out, alpha = blend(HEAD, neighbours([1.0], [900]), cfg, LEVELS)
    assert alpha[0] == pytest.approx(1 / 1.5)
    median = to_tokens(out[:, 2])[0]
    assert abs(np.log(median / 900)) < abs(np.log(120 / 900)) / 2, "the repeat outweighs the head (in log space)"
    assert np.all(np.diff(out[0]) > 0), "quantiles stay ordered"
    weak, weak_alpha = blend(HEAD, neighbours([0.81], [900]), cfg, LEVELS)
    assert weak_alpha[0] < 0.05 and to_tokens(weak[:, 2])[0] < 200, "a weak neighbour barely moves it"
    _, below_alpha = blend(HEAD, neighbours([0.5], [900]), cfg, LEVELS)
    assert below_alpha[0] == 0.0, "neighbours under the threshold are ignored"


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.normal(size=(n, 384)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_history_searches_each_served_model_separately() -> None:
    rng = np.random.default_rng(0)
    vecs = unit(rng, 50)
    h = History()
    h.add("a", vecs[:25], np.arange(25) + 1)
    h.add("b", vecs[25:], np.arange(25) + 100)
    nb = h.search(["a", "b", "c"], vecs[[3, 30, 3]], 3)
    assert nb.similarity[0, 0] == pytest.approx(1.0) and np.expm1(nb.log_length[0, 0]) == pytest.approx(4)
    assert np.expm1(nb.log_length[1, 0]) == pytest.approx(105)
    assert np.all(np.isinf(nb.similarity[2])), "a model without history gets no neighbours"
    assert len(h) == 50 and h.size("a") == 25


def test_hnsw_index_agrees_with_exact_search_on_the_nearest_neighbour() -> None:
    pytest.importorskip("faiss")
    rng = np.random.default_rng(1)
    vecs = unit(rng, HNSW_MIN + 500)
    big, small = History(), History()
    big.add("m", vecs, np.arange(len(vecs)) + 1)
    small.add("m", vecs[:1000], np.arange(1000) + 1)
    queries = vecs[:200] + 0.01 * unit(rng, 200)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    nb = big.search(["m"] * 200, queries, 4)
    exact = small.search(["m"] * 200, queries, 4)
    assert big._indexes["m"].is_hnsw and not small._indexes["m"].is_hnsw
    assert np.mean(np.rint(np.expm1(nb.log_length[:, 0])) == np.arange(200) + 1) > 0.97
    np.testing.assert_allclose(np.expm1(exact.log_length[:, 0]), np.arange(200) + 1, rtol=1e-5)


def test_circuit_breaker_opens_after_failures_and_half_opens_after_the_reset_time() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=2, reset_s=1.0, clock=lambda: now[0])
    assert b.allow() and not b.record_failure()
    assert b.record_failure() and b.state == "open" and not b.allow()
    now[0] = 1.5
    assert b.state == "half_open" and b.allow()
    assert not b.record_failure() and b.state == "open", "a failed trial waits another reset time"
    now[0] = 3.0
    assert b.record_success() and b.state == "closed"


def test_memory_cache_expires_evicts_and_keys_hide_the_prompt() -> None:
    async def run() -> None:
        cache = MemoryCache(max_entries=2, ttl_s=0.05)
        p = LengthPrediction(10, ((0.5, 10),))
        keys = [cache_key("t", "v1", "m", f"secret prompt {i}") for i in range(3)]
        assert all("secret" not in k for k in keys)
        assert cache_key("t", "v1", "m", "x") != cache_key("t", "v2", "m", "x") != cache_key("t", "v1", "n", "x")
        await cache.set_many([(keys[0], p), (keys[1], p), (keys[2], p)])
        assert await cache.get_many(keys) == [None, p, p], "least recently used evicted"
        await asyncio.sleep(0.07)
        assert await cache.get_many(keys[1:]) == [None, None], "expired"

    asyncio.run(run())


def test_spread_is_calibrated_so_that_p10_to_p90_holds_about_80_percent() -> None:
    from predictor_service.blend import calibrate_spread

    rng = np.random.default_rng(0)
    true = np.rint(np.exp(rng.normal(5.0, 0.8, size=4000))).astype(np.int64)
    # a head that knows the centre but claims half the real spread
    head = np.log1p(np.exp(5.0 + 0.4 * np.array([-1.2816, -0.6745, 0.0, 0.6745, 1.2816])))
    head_q = np.tile(head, (len(true), 1))
    cfg, covered = calibrate_spread(head_q, neighbours([], []), BlendConfig(k=4), LEVELS, true)
    assert cfg.spread >= 1.75 and abs(covered - 0.8) < 0.06, (cfg.spread, covered)


def test_mode_bin_point_moves_the_median_the_least_distance_into_the_most_probable_bin() -> None:
    from predictor_service.blend import mode_bin_point

    probs = np.zeros((4, 10))
    probs[[0, 1, 2, 3], [2, 2, 0, 9]] = 1.0
    got = mode_bin_point(np.array([250, 420, 150, 640]), probs)
    # already inside: kept; above the bin: its top; below: the bin's floor (>= 1); the last bin is open
    assert got.tolist() == [250, 299, 99, 900]
    assert mode_bin_point(np.array([5000]), probs[[3]]).tolist() == [5000]


def test_bin_probabilities_mix_the_head_with_neighbour_votes_by_the_blend_weight() -> None:
    from predictor_service.blend import bin_probabilities, point_tokens

    head = np.full((1, 10), 0.1)
    head[0, 1] = 0.3
    head /= head.sum()
    cfg = BlendConfig(k=4, threshold=0.8, temperature=0.05, kappa=0.5, point="mode_bin")
    probs = bin_probabilities(head, neighbours([1.0, 1.0], [720, 760]), cfg)
    alpha = 2.0 / 2.5
    assert probs.sum() == pytest.approx(1.0)
    assert probs[0, 7] == pytest.approx(alpha + (1 - alpha) * head[0, 7]) and probs.argmax() == 7
    assert np.allclose(bin_probabilities(head, neighbours([], []), cfg), head), "no neighbours: the head alone"
    log_q = np.log1p(np.array([[80.0, 120.0, 150.0, 250.0, 400.0]]))
    nb = neighbours([1.0, 1.0], [720, 760])
    assert point_tokens(log_q, head, nb, cfg, 2)[0] == 700, "the median moved up into the neighbours' bin"
    assert point_tokens(log_q, head, nb, BlendConfig(k=4), 2)[0] == 150, "median: ALISE's regression point"
    assert point_tokens(log_q, None, nb, cfg, 2)[0] == 150, "a head without bins keeps the median"
