"""Predictions for a whole trace at once, for the simulator's `--length-source predictor:DIR`.

    predict_prompts(model_dir, texts, served_model, cache_path)
        cache_path holds this (version, model, prompts) already? -> read it
        else LengthPredictor over batches of 64 (progress bar) -> write cache_path -> predictions

The cache file is JSON: the predictor version, the served model, one SHA-256 per prompt (no
prompt text) and the predictions. Any mismatch recomputes. Retrieval uses the model
directory's seed history only (no Observe happens in a simulation), so a trace replays the
same predictions every time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from predictor_service import artefacts
from predictor_service.cache import prompt_digest
from sluice.contract.length_prediction import LengthPrediction

BATCH = 64


def default_cache_path(model_dir: str | Path, texts: Sequence[str], served_model: str) -> Path:
    config = artefacts.read_config(model_dir)
    h = hashlib.sha256(config["version"].encode())
    h.update(served_model.encode())
    for t in texts:
        h.update(prompt_digest(served_model, t).encode())
    return artefacts.cache_dir() / "traces" / f"{h.hexdigest()[:20]}.json"


def _read(path: Path, version: str, served_model: str, digests: list[str]) -> list[LengthPrediction] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if data.get("version") != version or data.get("model") != served_model or data.get("prompts") != digests:
        return None
    return [LengthPrediction.from_dict(p) for p in data["predictions"]]


def predict_prompts(
    model_dir: str | Path | None,
    texts: Sequence[str],
    served_model: str = "",
    cache_path: str | Path | None = None,
    *,
    progress: bool = True,
) -> list[LengthPrediction]:
    """One prediction per text (in order), computed once per (predictor version, model, prompts)."""
    from tqdm import tqdm

    from predictor_service.predictor import LengthPredictor

    model_dir = Path(model_dir) if model_dir is not None else artefacts.default_model_dir()
    version = artefacts.read_config(model_dir)["version"]
    digests = [prompt_digest(served_model, t) for t in texts]
    path = Path(cache_path) if cache_path is not None else default_cache_path(model_dir, texts, served_model)
    cached = _read(path, version, served_model, digests)
    if cached is not None:
        return cached
    predictor = LengthPredictor(model_dir, threads=2)
    preds: list[LengthPrediction] = []
    bar = tqdm(total=len(texts), desc="predicting lengths", unit="prompt", disable=not progress, leave=False)
    for start in range(0, len(texts), BATCH):
        chunk = list(texts[start : start + BATCH])
        preds += predictor.predict(chunk, served_model)
        bar.update(len(chunk))
    bar.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": version, "model": served_model, "prompts": digests, "predictions": [p.to_dict() for p in preds]}
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return preds
