"""The serving-time predictor: ONNX encoder + ONNX head + retrieval history + blend (no torch).

    texts, served models --embed--> unit vectors [B, 384] (one onnxruntime call per batch)
          --head (embedding, size features, model index)--> log-length quantiles [B, 5]
          --history.search (per model) + blend--> LengthPrediction per text
    observe(embedding, model, tokens) --> history.add  (online learning)

A served model the head has not seen (our demo models) uses the head's "unknown model" entry
and collects its own history through `observe`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service import artefacts
from predictor_service.blend import BlendConfig, blend, point_tokens, to_tokens
from predictor_service.encoder import OnnxEncoder, PromptTokenizer, size_features
from predictor_service.head import OnnxHead
from predictor_service.retrieval import History
from sluice.contract.length_prediction import SOURCE_BLEND, SOURCE_HEAD, SOURCE_RETRIEVAL, LengthPrediction


def load_history_file(path: Path, history: History) -> int:
    """Adds a history.npz (seed or export) to `history`; returns the entries added."""
    if not path.is_file():
        return 0
    data = np.load(path)
    models = data["models"].astype(str)
    for model in sorted(set(models)):
        rows = models == model
        history.add(model, data["embeddings"][rows].astype(np.float32), data["tokens"][rows])
    return len(models)


def _source(alpha: float) -> str:
    if alpha <= 0.0:
        return SOURCE_HEAD
    return SOURCE_RETRIEVAL if alpha >= 0.5 else SOURCE_BLEND


class LengthPredictor:
    """Loads a model directory (see artefacts.py) and predicts in batches; thread-safe for reads
    and `observe` (the history locks itself; onnxruntime sessions allow concurrent runs)."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        threads: int = 1,
        device: str = "auto",
        load_seed_history: bool = True,
        precision: str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else artefacts.default_model_dir()
        self.config = artefacts.read_config(self.model_dir)
        self.version: str = self.config["version"]
        self.levels = tuple(float(q) for q in self.config["quantile_levels"])
        self.median_at = self.levels.index(0.5)
        self.blend_config = BlendConfig(**self.config["blend"])
        self._model_index = {m: i for i, m in enumerate(self.config["models"])}
        tokenizer = PromptTokenizer(max_input_tokens=self.config["encoder"]["max_input_tokens"])
        self.precision = precision or self.config["encoder"]["precision"]
        encoder = artefacts.encoder_path(self.model_dir, precision=self.precision)
        self.encoder = OnnxEncoder(encoder, tokenizer, threads, device)
        self.head = OnnxHead(self.model_dir / artefacts.HEAD_FILE, threads)
        self.history = History()
        self.seed_entries = (
            load_history_file(self.model_dir / artefacts.HISTORY_FILE, self.history) if load_seed_history else 0
        )

    def with_new_history(self) -> LengthPredictor:
        """The same model (sessions shared: they hold no state) with a fresh history holding
        only the directory's seed: what a restarted process starts from."""
        clone = object.__new__(LengthPredictor)
        clone.__dict__.update(self.__dict__)
        clone.history = History()
        clone.seed_entries = load_history_file(self.model_dir / artefacts.HISTORY_FILE, clone.history)
        return clone

    @property
    def provider(self) -> str:
        return self.encoder.provider

    def model_index(self, model: str) -> int:
        return self._model_index.get(model, 0)

    def knows_model(self, model: str) -> bool:
        return model in self._model_index and model != ""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        ids, mask = self.encoder.tokenizer.batch(list(texts))
        return self.encoder.encode_ids(ids, mask)

    def predict_embedded(
        self, embeddings: np.ndarray, texts: Sequence[str], models: Sequence[str]
    ) -> list[LengthPrediction]:
        t0 = time.perf_counter()
        index = np.array([self.model_index(m) for m in models], dtype=np.int64)
        head_q, head_probs = self.head(embeddings, size_features(texts), index)
        nb = self.history.search(list(models), embeddings, self.blend_config.k)
        log_q, alpha = blend(head_q, nb, self.blend_config, self.levels)
        tokens = to_tokens(log_q)
        points = point_tokens(log_q, head_probs, nb, self.blend_config, self.median_at)
        latency = (time.perf_counter() - t0) / max(1, len(texts))
        return [
            LengthPrediction(
                int(point),
                tuple(zip(self.levels, (int(v) for v in row), strict=True)),
                _source(float(a)),
                self.version,
                latency,
            )
            for point, row, a in zip(points, tokens, alpha, strict=True)
        ]

    def predict(
        self, texts: Sequence[str], models: Sequence[str] | str = "", max_tokens: Sequence[int] | None = None
    ) -> list[LengthPrediction]:
        """One batch: encode, head, retrieval, blend; each prediction clipped to its max_tokens (0 = none)."""
        t0 = time.perf_counter()
        models = [models] * len(texts) if isinstance(models, str) else list(models)
        if not texts:
            return []
        preds = self.predict_embedded(self.embed(texts), texts, models)
        latency = (time.perf_counter() - t0) / len(texts)
        caps = max_tokens or [0] * len(texts)
        return [p.clipped(c).with_source(p.source, latency) for p, c in zip(preds, caps, strict=True)]

    def observe(self, embedding: np.ndarray, model: str, tokens: int) -> None:
        self.history.add(model, embedding.reshape(1, -1), [tokens])

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "provider": self.provider,
            "precision": self.precision,
            "history_entries": len(self.history),
            "seed_entries": self.seed_entries,
            "models": len(self._model_index) - 1,
        }
