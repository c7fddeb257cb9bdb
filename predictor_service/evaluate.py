"""`sluice predictor eval`: accuracy and latency of a model directory on a prompt file.

    load_samples(FILE) --split (test: the held-out groups of the training rule; all)--> samples
    accuracy: LengthPredictor.predict in batches of 64 -> bucket_accuracy, mae_tokens, spearman
    latency:  one prompt per call, uncached, `threads` onnxruntime threads -> p50_ms, p99_ms
    cached:   PredictorEngine with its in-process cache, the same prompts again -> cached_p50_ms
    + the error model of these predictions (error_model.json beside the JSON output)

The model directory is served as is: its seed history, not the full training history that
`train` evaluates with (see metrics.json of the directory for that number).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service.data import Sample, load_samples, split_samples
from predictor_service.metrics import coverage, mode_bucket_rate, point_metrics
from predictor_service.predictor import LengthPredictor
from sluice.contract.length_prediction import LengthErrorModel, LengthPrediction


def select(samples: list[Sample], split: str, first_turn_only: bool, limit: int | None, seed: int = 0) -> list[Sample]:
    chosen = split_samples(samples)["test"] if split == "test" else samples
    if first_turn_only:
        chosen = [s for s in chosen if s.first_turn]
    if limit is not None and len(chosen) > limit:
        rng = np.random.default_rng(seed)
        chosen = [chosen[i] for i in sorted(rng.choice(len(chosen), limit, replace=False))]
    return chosen


def batch_predictions(predictor: LengthPredictor, samples: list[Sample], progress: bool) -> list[LengthPrediction]:
    from tqdm import tqdm

    out: list[LengthPrediction] = []
    bar = tqdm(total=len(samples), desc="predicting", unit="prompt", disable=not progress, leave=False)
    for start in range(0, len(samples), 64):
        chunk = samples[start : start + 64]
        out += predictor.predict([s.prompt for s in chunk], [s.model for s in chunk])
        bar.update(len(chunk))
    bar.close()
    return out


def single_latencies(predictor: LengthPredictor, samples: list[Sample], n: int) -> np.ndarray:
    """Seconds per uncached prediction of one prompt (tokenize, encode, head, search, blend)."""
    predictor.predict([samples[0].prompt], samples[0].model)  # warm-up
    times = []
    for s in samples[:n]:
        t0 = time.perf_counter()
        predictor.predict([s.prompt], s.model)
        times.append(time.perf_counter() - t0)
    return np.array(times)


async def _cached_latencies(predictor: LengthPredictor, samples: list[Sample], n: int) -> np.ndarray:
    from predictor_service.engine import EngineConfig, PredictorEngine, Query

    engine = PredictorEngine(predictor, EngineConfig(batch_window_s=0.0))
    await engine.start()
    queries = [Query(str(i), s.prompt, s.model) for i, s in enumerate(samples[:n])]
    try:
        await engine.predict(queries)
        await asyncio.sleep(0.01)  # the background cache writes
        times = []
        for q in queries:
            t0 = time.perf_counter()
            (pred,) = await engine.predict([q])
            times.append(time.perf_counter() - t0)
            assert pred.source == "cache", pred.source
    finally:
        await engine.close()
    return np.array(times)


def evaluate(
    model_dir: str | Path | None,
    prompts: str | Path,
    *,
    split: str = "test",
    first_turn_only: bool = False,
    limit: int | None = None,
    latency_samples: int = 200,
    threads: int = 1,
    precision: str | None = None,
    progress: bool = True,
) -> tuple[dict[str, Any], LengthErrorModel]:
    samples = select(load_samples(prompts), split, first_turn_only, limit)
    if not samples:
        raise ValueError(f"{prompts}: no samples left after --split {split}")
    predictor = LengthPredictor(model_dir, threads=threads, precision=precision)
    preds = batch_predictions(predictor, samples, progress)
    true = np.array([s.output_tokens for s in samples])
    points = np.array([p.tokens for p in preds])
    single = single_latencies(predictor, samples, latency_samples)
    cached = asyncio.run(_cached_latencies(predictor, samples, latency_samples))
    report: dict[str, Any] = {
        **point_metrics(true, points),
        "p50_ms": float(np.percentile(single, 50) * 1e3),
        "p99_ms": float(np.percentile(single, 99) * 1e3),
        "cached_p50_ms": float(np.percentile(cached, 50) * 1e3),
        "n": len(samples),
        "coverage_p10_p90": coverage(true, preds),
        "mode_bucket_rate": mode_bucket_rate(true),
        "sources": dict(zip(*np.unique([p.source for p in preds], return_counts=True), strict=True)),
        "provider": predictor.provider,
        "threads": threads,
        "precision": predictor.precision,
        "predictor_version": predictor.version,
        "model_dir": str(predictor.model_dir),
        "prompts": str(prompts),
        "split": split,
        "first_turn_only": first_turn_only,
        "history_entries": len(predictor.history),
    }
    report["sources"] = {str(k): int(v) for k, v in report["sources"].items()}
    error_model = LengthErrorModel.fit(
        true,
        preds,
        predictor_version=predictor.version,
        description=f"sluice predictor eval on {Path(prompts).name} ({split})",
    )
    return report, error_model
