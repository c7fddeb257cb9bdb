"""Length predictor: does training the encoder end to end beat the frozen encoder?

    python benchmarks/predictor_finetune.py [--ranks 0,16] [--epochs 8] \
        [--json docs/results/data/predictor_finetune.json]

The served predictor keeps MiniLM frozen and trains only its head; the measured accuracy gap
to ALISE (docs/results/predictor.md) left one lever untried: an encoder trained on
the length task itself. This trains, on the predictor's own split (ShareGPT first turns and
AlpacaEval, disjoint by group, repeats of train prompts dropped), the two-layer encoder the
service runs together with the predictor's head (`build_head`, `head_loss`: five quantiles of
log length and ALISE's ten bins), end to end:

    rank 0   the encoder frozen: only the head trains (the served recipe, in this same loop)
    rank r   low-rank adapters (LoRA, B A with A: r x in, B: out x r, B = 0 at the start) on
             every linear map of both transformer layers (query, key, value, attention output,
             both feed-forward maps), trained with the head; the base weights stay frozen, so
             the encoder a model directory would ship is the package's plus r x (in + out)
             numbers per map

Each epoch scores the head's most probable bin (bucket accuracy, ALISE's rule) on val and
test, ShareGPT first turns and AlpacaEval separately; the epoch reported is the best on val
(mean over the two sources), so test is read, never chosen on. Batches are unique prompts (an
AlpacaEval instruction carries its 32 generators' lengths, the served model an input of the
head, shown as "unknown" for 15% of samples, as in training); prompts of similar length are
batched together within random chunks, so padding stays small. About 2 minutes per epoch for a
rank > 0 and 1 for rank 0 on the shared 2 cores (progress bars show it).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from predictor_service.data import OutputTokenCounter, Sample, load_samples, split_samples
from predictor_service.encoder import PromptTokenizer, load_pooled_encoder, size_features
from predictor_service.head import QUANTILE_LEVELS, build_head, head_loss
from predictor_service.train import model_vocabulary
from sluice.common.paths import data_file
from sluice.contract.length_prediction import length_bucket
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

SOURCES = ("prompts/sharegpt_v3_conversations.jsonl.gz", "prompts/alpaca_eval_outputs_32models.jsonl.gz")
LAYERS = 2  # the served encoder's depth
UNKNOWN_RATE = 0.15
HEAD_LR = 1e-3


class LowRankAdapted(nn.Module):
    """y = W x + b + (alpha / r) B A x, with W and b frozen (LoRA)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale


def adapted_encoder(rank: int) -> nn.Module:
    """The served two-layer pooled encoder, frozen, with adapters of `rank` on every linear map."""
    encoder = load_pooled_encoder(LAYERS)
    for p in encoder.parameters():
        p.requires_grad_(False)
    if rank <= 0:
        return encoder
    for layer in encoder.bert.encoder.layer:
        attention = layer.attention.self
        for name in ("query", "key", "value"):
            setattr(attention, name, LowRankAdapted(getattr(attention, name), rank))
        layer.attention.output.dense = LowRankAdapted(layer.attention.output.dense, rank)
        layer.intermediate.dense = LowRankAdapted(layer.intermediate.dense, rank)
        layer.output.dense = LowRankAdapted(layer.output.dense, rank)
    return encoder


class Prompts:
    """The unique prompts of a split, each with its (model index, tokens, source) samples."""

    def __init__(self, samples: Sequence[Sample], model_index: dict[str, int]) -> None:
        rows: dict[str, list[tuple[int, int, str]]] = {}
        for s in samples:
            rows.setdefault(s.prompt, []).append((model_index.get(s.model, 0), s.output_tokens, s.source))
        self.texts = list(rows)
        self.rows = [rows[t] for t in self.texts]
        self.chars = np.array([len(t) for t in self.texts])


def batches_of(prompts: Prompts, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random batches of similar-length prompts: sorted by length inside random chunks of 50 batches."""
    order = rng.permutation(len(prompts.texts))
    out: list[np.ndarray] = []
    for start in range(0, len(order), size * 50):
        chunk = order[start : start + size * 50]
        chunk = chunk[np.argsort(prompts.chars[chunk], kind="stable")]
        out += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(out)  # type: ignore[arg-type]
    return out


def forward(
    encoder: nn.Module, head: nn.Module, tok: PromptTokenizer, prompts: Prompts, batch: np.ndarray, unknown: float
) -> tuple[Any, np.ndarray, list[str]]:
    """Head outputs for every sample of the batch's prompts, their true lengths and sources."""
    texts = [prompts.texts[i] for i in batch]
    ids, mask = tok.batch(texts)
    emb = encoder(torch.from_numpy(ids), torch.from_numpy(mask))
    size = torch.from_numpy(size_features(texts))
    rows = [prompts.rows[i] for i in batch]
    owner = torch.tensor([k for k, r in enumerate(rows) for _ in r])
    models = torch.tensor([m for r in rows for m, _, _ in r])
    if unknown > 0:
        models = torch.where(torch.rand(len(models)) < unknown, 0, models)
    tokens = np.array([t for r in rows for _, t, _ in r])
    return head(emb[owner], size[owner], models), tokens, [s for r in rows for _, _, s in r]


def evaluate(encoder: nn.Module, head: nn.Module, tok: PromptTokenizer, prompts: Prompts) -> dict[str, float]:
    """Bucket accuracy of the most probable bin, per source."""
    encoder.eval()
    head.eval()
    hits: dict[str, list[bool]] = {}
    order = np.argsort(prompts.chars, kind="stable")
    with torch.inference_mode():
        for start in range(0, len(order), 64):
            (_, logits), tokens, sources = forward(encoder, head, tok, prompts, order[start : start + 64], 0.0)
            right = logits.argmax(1).numpy() == length_bucket(tokens)
            for ok, src in zip(right, sources, strict=True):
                hits.setdefault(src, []).append(bool(ok))
    return {src: float(np.mean(v)) for src, v in sorted(hits.items())}


def run(rank: int, parts: dict[str, list[Sample]], args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    vocab = model_vocabulary(parts["train"])
    index = {m: i for i, m in enumerate(vocab)}
    train, val, test = (Prompts(parts[k], index) for k in ("train", "val", "test"))
    tok = PromptTokenizer(max_input_tokens=128)
    encoder, head = adapted_encoder(rank), build_head(len(vocab))
    adapters = [p for p in encoder.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": list(head.parameters()), "lr": HEAD_LR}]
    if adapters:
        groups.append({"params": adapters, "lr": args.lr})
    opt = torch.optim.AdamW(groups, weight_decay=1e-4)
    epochs = []
    for epoch in range(args.epochs):
        encoder.train()
        head.train()
        t0, total, batches = time.perf_counter(), 0.0, batches_of(train, args.batch, rng)
        for batch in tqdm(batches, desc=f"rank {rank} epoch {epoch}", unit="batch", leave=False):
            out, tokens, _ = forward(encoder, head, tok, train, batch, UNKNOWN_RATE)
            y = torch.from_numpy(np.log1p(tokens).astype(np.float32))
            yb = torch.from_numpy(length_bucket(tokens).astype(np.int64))
            loss = head_loss(out, y, yb, QUANTILE_LEVELS)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        row = {
            "epoch": epoch,
            "train_loss": total / len(batches),
            "seconds": time.perf_counter() - t0,
            "val": evaluate(encoder, head, tok, val),
            "test": evaluate(encoder, head, tok, test),
        }
        epochs.append(row)
        print(f"rank {rank} epoch {epoch}: val {row['val']} test {row['test']}", flush=True)
    best = max(epochs, key=lambda r: float(np.mean(list(r["val"].values()))))
    return {
        "rank": rank,
        "adapter_parameters": sum(p.numel() for p in adapters),
        "best_epoch": best["epoch"],
        "test_at_best_val": best["test"],
        "epochs": epochs,
    }


def results_table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        acc = r["test_at_best_val"]
        rows.append(
            {
                "encoder": "frozen (head only)" if r["rank"] == 0 else f"LoRA rank {r['rank']}, end to end",
                "adapter parameters": r["adapter_parameters"],
                "best val epoch": r["best_epoch"],
                "test bucket accuracy: ShareGPT first turns / AlpacaEval": (
                    f"{acc.get('sharegpt', float('nan')):.3f} / {acc.get('alpaca-eval', float('nan')):.3f}"
                ),
            }
        )
    return format_table(rows, formats={"adapter parameters": "{:,}"})


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--ranks", default="0,16", help="adapter ranks to train, comma-separated (0: frozen encoder)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="unique prompts per batch")
    parser.add_argument("--lr", type=float, default=5e-4, help="learning rate of the adapters (the head: 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, help="samples per source (a quick check; the results use all)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counter = OutputTokenCounter()
    samples = [s for p in SOURCES for s in load_samples(data_file(p), counter=counter, limit=args.limit)]
    samples = [s for s in samples if s.first_turn or s.source != "sharegpt"]
    parts = split_samples(samples)
    runs = [run(int(r), parts, args) for r in args.ranks.split(",")]
    print(results_table(runs))
    if args.json:
        out = {
            "split": {k: len(v) for k, v in parts.items()},
            "args": vars(args),
            "runs": runs,
            "load_average": list(os.getloadavg()),
        }
        write_json(out, args.json, indent=2, quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
