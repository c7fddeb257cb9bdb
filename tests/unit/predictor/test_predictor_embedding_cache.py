"""The on-disk embedding cache of training runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor_service.embedding_cache import EmbeddingCache, text_key


class CountingEncoder:
    """Deterministic vectors per text, counting how many texts it was asked to encode."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        self.encoded += len(texts)
        return np.array([np.full(384, len(t), dtype=np.float32) for t in texts])


def test_cache_survives_a_reload_including_digests_ending_in_nul(tmp_path) -> None:
    nul = next(f"prompt {i}" for i in range(100_000) if text_key(f"prompt {i}").endswith(b"\x00"))
    texts = ["a", nul, "bbb", "a"]
    enc = CountingEncoder()
    first = EmbeddingCache(128, tmp_path / "e.npz").embed(texts, progress=False, encoder=enc)
    assert enc.encoded == 3, "a repeated text is encoded once"
    again = CountingEncoder()
    second = EmbeddingCache(128, tmp_path / "e.npz").embed([*texts, "cc"], progress=False, encoder=again)
    assert again.encoded == 1, "only the new text is encoded after a reload"
    np.testing.assert_array_equal(second[:4], first)
    assert second[4, 0] == 2
