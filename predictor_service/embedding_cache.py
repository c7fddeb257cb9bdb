"""An on-disk cache of prompt embeddings for training and evaluation runs.

    texts --embed(texts)--> hits from cache_dir()/embeddings-<tag>.npz, misses encoded with the
          torch encoder (progress bar), appended and saved --> float32 [N, 384] in input order

Keyed by a SHA-1 of each prompt text; the tag names the encoder export settings (input cap),
so a run with another cap (or fewer layers) never reads vectors it did not compute. Encoding the shared
ShareGPT + AlpacaEval prompts once takes minutes on two cores; every later run reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictor_service.artefacts import cache_dir
from predictor_service.encoder import EMBEDDING_DIM, FULL_LAYERS


def text_key(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()


class EmbeddingCache:
    def __init__(self, max_input_tokens: int, path: Path | None = None, layers: int = FULL_LAYERS) -> None:
        self.max_input_tokens = max_input_tokens
        self.layers = layers
        tag = f"{max_input_tokens}" if layers == FULL_LAYERS else f"{max_input_tokens}-l{layers}"
        self.path = path or cache_dir() / f"embeddings-minilm-fp32-{tag}.npz"
        self._rows: dict[bytes, int] = {}
        self._vectors = np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        if self.path.is_file():
            data = np.load(self.path)
            self._vectors = data["vectors"]
            # NOTE: keys are stored as uint8 rows: numpy's bytes dtype would strip a digest's trailing NULs.
            self._rows = {k.tobytes(): i for i, k in enumerate(data["keys"])}

    def embed(self, texts: Sequence[str], progress: bool = True, encoder: object | None = None) -> np.ndarray:
        keys = [text_key(t) for t in texts]
        missing = list({k: t for k, t in zip(keys, texts, strict=True) if k not in self._rows}.items())
        if missing:
            from predictor_service.encoder import PromptTokenizer, TorchEncoder

            tokenizer = PromptTokenizer(max_input_tokens=self.max_input_tokens)
            enc = encoder or TorchEncoder(tokenizer, layers=self.layers)
            vectors = enc.encode([t for _, t in missing], progress=progress)  # type: ignore[attr-defined]
            start = len(self._vectors)
            self._vectors = np.concatenate([self._vectors, vectors])
            self._rows.update({k: start + i for i, (k, _) in enumerate(missing)})
            self._save()
        return self._vectors[[self._rows[k] for k in keys]]

    def _save(self) -> None:
        keys = np.zeros((len(self._vectors), 20), dtype=np.uint8)
        for k, i in self._rows.items():
            keys[i] = np.frombuffer(k, dtype=np.uint8)
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=keys, vectors=self._vectors)
        tmp.replace(self.path)
