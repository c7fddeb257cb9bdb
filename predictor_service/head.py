"""The all-MLP head: (prompt embedding, prompt size, served model) -> quantiles of log(1 + length).

    embedding [B, 384] --+
    size features [B, 2] -+--concat--> Linear-GELU-Dropout x2 (hidden 256) --> p50 and softplus
    model index [B] --Embedding(num_models, 16)--+                            steps below/above it

The served model is an input: index 0 is "unknown model" (trained by replacing the true
generator with it on a random 15% of samples, so it learns the marginal over generators),
then one entry per generator seen in training. Quantiles are monotone by construction (the
median plus/minus cumulative softplus steps) and trained with the pinball loss.
`OnnxHead` runs the exported graph for serving; the torch module is for training and export.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

QUANTILE_LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9)
MODEL_EMBEDDING_DIM = 16
HIDDEN = 256


def build_head(num_models: int, levels: Sequence[float] = QUANTILE_LEVELS, dropout: float = 0.1) -> Any:
    import torch
    from torch import nn

    from predictor_service.encoder import EMBEDDING_DIM

    median_at = list(levels).index(0.5)

    class LengthHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model_embedding = nn.Embedding(num_models, MODEL_EMBEDDING_DIM)
            self.mlp = nn.Sequential(
                nn.Linear(EMBEDDING_DIM + 2 + MODEL_EMBEDDING_DIM, HIDDEN),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(HIDDEN, HIDDEN),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(HIDDEN, len(levels)),
            )

        def forward(self, prompt_embedding: Any, size_features: Any, model_index: Any) -> Any:
            x = torch.cat([prompt_embedding, size_features, self.model_embedding(model_index)], dim=1)
            raw = self.mlp(x)
            median = raw[:, median_at : median_at + 1] + 5.0  # NOTE: log(1 + 150), the data's rough centre
            below = torch.flip(torch.cumsum(torch.flip(nn.functional.softplus(raw[:, :median_at]), [1]), 1), [1])
            above = torch.cumsum(nn.functional.softplus(raw[:, median_at + 1 :]), 1)
            return torch.cat([median - below, median, median + above], dim=1)

    return LengthHead()


def pinball_loss(pred: Any, target: Any, levels: Sequence[float]) -> Any:
    import torch

    q = torch.tensor(list(levels), dtype=pred.dtype).unsqueeze(0)
    diff = target.unsqueeze(1) - pred
    return torch.maximum(q * diff, (q - 1) * diff).mean()


class OnnxHead:
    """The exported head: log-length quantiles [B, L] from embeddings, size features, model indices."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        from predictor_service.encoder import make_session

        # NOTE: always on CPU: a 100k-parameter MLP costs less than a host-device copy.
        self.session = make_session(path, threads, device="cpu")

    def __call__(self, embedding: np.ndarray, size_features: np.ndarray, model_index: np.ndarray) -> np.ndarray:
        feeds = {
            "prompt_embedding": np.ascontiguousarray(embedding, dtype=np.float32),
            "size_features": np.ascontiguousarray(size_features, dtype=np.float32),
            "model_index": np.ascontiguousarray(model_index, dtype=np.int64),
        }
        (out,) = self.session.run(None, feeds)
        return np.asarray(out, dtype=np.float64)


class TorchHead:
    """The torch head behind the OnnxHead interface (training-time evaluation)."""

    def __init__(self, module: Any) -> None:
        self.module = module.eval()

    def __call__(self, embedding: np.ndarray, size_features: np.ndarray, model_index: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.module(
                torch.from_numpy(np.asarray(embedding, dtype=np.float32)),
                torch.from_numpy(np.asarray(size_features, dtype=np.float32)),
                torch.from_numpy(np.asarray(model_index, dtype=np.int64)),
            )
        return out.numpy().astype(np.float64)
