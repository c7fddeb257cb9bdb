"""Exports the encoder and the head to ONNX, and checks the encoder against torch.

    PooledEncoder (torch) --torch.onnx.export (dynamic batch and sequence)--> encoder.onnx (fp32)
                          --onnxruntime dynamic int8 quantization----------> encoder.onnx (int8)
    LengthHead (torch)    --torch.onnx.export (dynamic batch)--------------> head.onnx (quantiles, bin logits)
    then: IR version set to 10, onnx.checker, and (encoder) onnxruntime vs torch on a padded batch

NOTE: the TorchScript-based exporter (`dynamo=False`), for two measured reasons: it takes 1.7 s
where the dynamo exporter takes 14 s (the encoder is exported at first use), and only its
graphs quantize to int8 (ECOSYSTEM.md). Both match torch to about 2e-7 in fp32.
NOTE: onnx 1.23 writes IR version 14, which older onnxruntime releases cannot load; every
operator the graphs use exists at IR 10, so the version field is set to 10 before saving.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service.encoder import FULL_LAYERS

ONNX_IR_VERSION = 10
ONNX_OPSET = 17
PRECISIONS = ("fp32", "int8")
ENCODER_TOLERANCE = 1e-4

# Prompts of very different lengths, so the check batch is padded (mask zeros matter).
CHECK_PROMPTS = (
    "Hi",
    "Write a haiku about the sea.",
    "Summarize the main ideas of Jeff Walker's Product Launch Formula into bullet points as it pertains to a "
    "growth marketing agency implementing these strategies and tactics for their clients.",
    "How did US states get their names? " * 20,
)


def _set_ir10(path: Path) -> None:
    import onnx

    model = onnx.load(str(path))
    model.ir_version = ONNX_IR_VERSION
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _export(module: Any, args: tuple[Any, ...], names: tuple[list[str], list[str]], dynamic: dict, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=names[0],
            output_names=names[1],
            dynamic_axes=dynamic,
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
    _set_ir10(path)


def export_encoder(
    path: str | Path, max_input_tokens: int = 128, precision: str = "fp32", layers: int = FULL_LAYERS
) -> Path:
    """Writes the pooled MiniLM encoder (its first `layers` layers; dynamic batch and sequence
    axes) to `path`; `int8` quantizes its weights dynamically (4x smaller, faster on one core;
    measured in docs/results/predictor.md)."""
    import torch

    from predictor_service.encoder import PromptTokenizer, load_pooled_encoder

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    path = Path(path)
    module = load_pooled_encoder(layers)
    ids, mask = PromptTokenizer(max_input_tokens=max_input_tokens).batch(list(CHECK_PROMPTS[:2]))
    dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    args = (torch.from_numpy(ids), torch.from_numpy(mask))
    fp32 = path if precision == "fp32" else path.with_suffix(".fp32.tmp")
    _export(module, args, (["input_ids", "attention_mask"], ["prompt_embedding"]), dynamic, fp32)
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(fp32), str(path), weight_type=QuantType.QInt8)
        fp32.unlink()
        _set_ir10(path)
    return path


def check_encoder(
    path: str | Path, max_input_tokens: int = 128, tolerance: float = ENCODER_TOLERANCE, layers: int = FULL_LAYERS
) -> float:
    """Largest absolute difference between the ONNX and the torch embeddings (same `layers`) of
    a padded batch; raises when it exceeds `tolerance`."""
    from predictor_service.encoder import OnnxEncoder, PromptTokenizer, TorchEncoder

    tokenizer = PromptTokenizer(max_input_tokens=max_input_tokens)
    ids, mask = tokenizer.batch(list(CHECK_PROMPTS))
    ref = TorchEncoder(tokenizer, layers=layers).encode_ids(ids, mask)
    got = OnnxEncoder(path, tokenizer, device="cpu").encode_ids(ids, mask)
    diff = float(np.max(np.abs(ref - got)))
    if diff > tolerance:
        raise RuntimeError(f"ONNX encoder differs from torch by {diff:.2e} (> {tolerance:g})")
    return diff


def export_head(head: Any, path: str | Path, num_models: int) -> Path:
    """Writes the trained LengthHead (inputs: embedding, size features, model index; outputs:
    log-length quantiles, bin logits) to `path`."""
    import torch

    from predictor_service.encoder import EMBEDDING_DIM

    head = head.eval()
    args = (torch.zeros(2, EMBEDDING_DIM), torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64) % max(num_models, 1))
    dynamic = {"prompt_embedding": {0: "batch"}, "size_features": {0: "batch"}, "model_index": {0: "batch"}}
    names = (["prompt_embedding", "size_features", "model_index"], ["log_quantiles", "bin_logits"])
    _export(head, args, names, dynamic, Path(path))
    return Path(path)
