"""The all-MLP head: (prompt embedding, prompt size, served model) -> quantiles of log(1 + length)
and the probabilities of ALISE's length bins.

    embedding [B, 384] --+                                                 +--> p50 and softplus steps
    size features [B, 2] -+--concat--> Linear-GELU-Dropout x2 (hidden 256) -+    below/above it [B, 5]
    model index [B] --Embedding(num_models, 16)--+                          +--> bin logits [B, 10]

The served model is an input: index 0 is "unknown model" (trained by replacing the true
generator with it on a random 15% of samples, so it learns the marginal over generators),
then one entry per generator seen in training. Quantiles are monotone by construction (the
median plus/minus cumulative softplus steps) and trained with the pinball loss; the bin
logits (sluice.contract.length_prediction: equal 100-token bins, the last one open) with cross-entropy,
on the same trunk. The median is the best point for error in tokens; the most probable bin is
the best guess under the bin rule, and the two differ when the length distribution is wide
(blend.py, `point`).
`OnnxHead` runs the exported graph for serving; the torch module is for training and export.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sluice.contract.length_prediction import NUM_BUCKETS

QUANTILE_LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9)
MODEL_EMBEDDING_DIM = 16
HIDDEN = 256
BIN_LOSS_WEIGHT = 0.1  # cross-entropy (about 2 nats) against the pinball loss (about 0.2)


def build_head(
    num_models: int, levels: Sequence[float] = QUANTILE_LEVELS, dropout: float = 0.1, num_bins: int = NUM_BUCKETS
) -> Any:
    """The torch module; forward returns (log-length quantiles [B, L], bin logits [B, num_bins])."""
    import torch
    from torch import nn

    from predictor_service.encoder import EMBEDDING_DIM

    median_at = list(levels).index(0.5)
    num_levels = len(levels)

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
                nn.Linear(HIDDEN, num_levels + num_bins),
            )

        def forward(self, prompt_embedding: Any, size_features: Any, model_index: Any) -> tuple[Any, Any]:
            x = torch.cat([prompt_embedding, size_features, self.model_embedding(model_index)], dim=1)
            out = self.mlp(x)
            raw, bin_logits = out[:, :num_levels], out[:, num_levels:]
            median = raw[:, median_at : median_at + 1] + 5.0  # NOTE: log(1 + 150), the data's rough centre
            below = torch.flip(torch.cumsum(torch.flip(nn.functional.softplus(raw[:, :median_at]), [1]), 1), [1])
            above = torch.cumsum(nn.functional.softplus(raw[:, median_at + 1 :]), 1)
            return torch.cat([median - below, median, median + above], dim=1), bin_logits

    return LengthHead()


def pinball_loss(pred: Any, target: Any, levels: Sequence[float]) -> Any:
    import torch

    q = torch.tensor(list(levels), dtype=pred.dtype).unsqueeze(0)
    diff = target.unsqueeze(1) - pred
    return torch.maximum(q * diff, (q - 1) * diff).mean()


def head_loss(out: tuple[Any, Any], log_target: Any, bin_target: Any, levels: Sequence[float]) -> Any:
    """Pinball loss of the quantiles plus BIN_LOSS_WEIGHT x cross-entropy of the bins."""
    import torch

    quantiles, bin_logits = out
    return pinball_loss(quantiles, log_target, levels) + BIN_LOSS_WEIGHT * torch.nn.functional.cross_entropy(
        bin_logits, bin_target
    )


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


class OnnxHead:
    """The exported head: (log-length quantiles [B, L], bin probabilities [B, bins]) from
    embeddings, size features, model indices. A head exported before the bins existed has one
    output; its bin probabilities are None."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        from predictor_service.encoder import make_session

        # NOTE: always on CPU: a 100k-parameter MLP costs less than a host-device copy.
        self.session = make_session(path, threads, device="cpu")

    def __call__(
        self, embedding: np.ndarray, size_features: np.ndarray, model_index: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        feeds = {
            "prompt_embedding": np.ascontiguousarray(embedding, dtype=np.float32),
            "size_features": np.ascontiguousarray(size_features, dtype=np.float32),
            "model_index": np.ascontiguousarray(model_index, dtype=np.int64),
        }
        out = self.session.run(None, feeds)
        probs = softmax(np.asarray(out[1], dtype=np.float64)) if len(out) > 1 else None
        return np.asarray(out[0], dtype=np.float64), probs


class TorchHead:
    """The torch head behind the OnnxHead interface (training-time evaluation)."""

    def __init__(self, module: Any) -> None:
        self.module = module.eval()

    def __call__(
        self, embedding: np.ndarray, size_features: np.ndarray, model_index: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        import torch

        with torch.inference_mode():
            quantiles, bin_logits = self.module(
                torch.from_numpy(np.asarray(embedding, dtype=np.float32)),
                torch.from_numpy(np.asarray(size_features, dtype=np.float32)),
                torch.from_numpy(np.asarray(model_index, dtype=np.int64)),
            )
        return quantiles.numpy().astype(np.float64), softmax(bin_logits.numpy().astype(np.float64))
