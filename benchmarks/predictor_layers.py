"""Length predictor: how many MiniLM layers, and which head, on ShareGPT first turns + AlpacaEval.

    python benchmarks/predictor_layers.py [--json docs/results/data/predictor_layers.json]

1. One torch pass over every unique prompt (ShareGPT first human turns and the AlpacaEval
   instructions, 128-token cap) keeps the mean-pooled, L2-normalised output of each layer
   0..6 (layer 0: the token embeddings alone; layer N: what an encoder cut after N layers
   computes, so each row is exactly that encoder's embedding).
2. Per layer, on the predictor's split (disjoint by group, repeats of train prompts dropped):
   - reg: an MLP on log length (L1 loss: its median), the point is the median
   - cls: the same MLP with cross-entropy over ALISE's ten 100-token bins, the point is the
     most probable bin
   - knn: per served model, the 16 most similar train prompts vote for their bins with
     weights exp((sim - 1) / 0.05)
   - ens a: (1 - a) * cls probabilities + a * knn votes, the most probable bin
   bucket accuracy on val and test, ShareGPT and AlpacaEval separately; the share of the most
   common bin; MAE of reg and cls points.
3. Neighbour agreement (six layers): for each held-out ShareGPT first turn, its most similar
   train or val prompt, and how often that prompt's answer shares the test answer's bin, by
   similarity band: how much a similar prompt tells about the length.
The MLPs are the predictor's head (hidden 256, served-model embedding, size features; 15% of
samples shown as "unknown model"), early-stopped on val. Takes about 25 minutes on 2 cores.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from predictor_service.data import OutputTokenCounter, Sample, load_samples, split_samples
from predictor_service.encoder import PromptTokenizer, load_pooled_encoder, size_features
from sluice.common.paths import data_file
from sluice.contract.length_prediction import bucket_accuracy, length_bucket
from sluice_bench.options import benchmark_parser
from sluice_bench.report import write_json

SOURCES = ("prompts/sharegpt_v3_conversations.jsonl.gz", "prompts/alpaca_eval_outputs_32models.jsonl.gz")
NB = 10
MID = np.arange(NB) * 100 + 50


def layer_embeddings(texts: list[str], cap: int = 128) -> np.ndarray:
    """[7, N, 384] mean-pooled unit vectors after each layer (0 = the token embeddings)."""
    import torch
    from tqdm import tqdm

    bert = load_pooled_encoder().bert
    tok = PromptTokenizer(max_input_tokens=cap)
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.zeros((7, len(texts), 384), dtype=np.float32)
    for start in tqdm(range(0, len(texts), 64), desc="encoding (all layers)", unit="batch"):
        rows = order[start : start + 64]
        ids, mask = tok.batch([texts[i] for i in rows])
        with torch.inference_mode():
            ids_t = torch.from_numpy(ids)
            o = bert(
                input_ids=ids_t,
                attention_mask=torch.from_numpy(mask),
                token_type_ids=torch.zeros_like(ids_t),
                output_hidden_states=True,
            )
        m = torch.from_numpy(mask).unsqueeze(-1).float()
        for layer, h in enumerate(o.hidden_states):
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out[layer, rows] = torch.nn.functional.normalize(pooled, dim=1).numpy()
    return out


def _mlp(nout: int, num_models: int) -> Any:
    import torch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.me = torch.nn.Embedding(num_models, 16)
            self.f = torch.nn.Sequential(
                torch.nn.Linear(384 + 2 + 16, 256),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(256, 256),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(256, nout),
            )

        def forward(self, e: Any, z: Any, m: Any) -> Any:
            return self.f(torch.cat([e, z, self.me(m)], 1))

    return Head()


def fit(tr: tuple, va: tuple, kind: str, num_models: int, epochs: int = 40, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    h = _mlp(NB if kind == "cls" else 1, num_models)
    opt = torch.optim.AdamW(h.parameters(), lr=1e-3, weight_decay=1e-4)
    x, vx = [torch.from_numpy(a) for a in tr[:3]], [torch.from_numpy(a) for a in va[:3]]
    if kind == "cls":
        y, vy = torch.from_numpy(length_bucket(tr[3])), torch.from_numpy(length_bucket(va[3]))
        lossf = torch.nn.functional.cross_entropy
    else:
        y = torch.from_numpy(np.log1p(tr[3]).astype(np.float32))
        vy = torch.from_numpy(np.log1p(va[3]).astype(np.float32))

        def lossf(p: Any, t: Any) -> Any:
            return (p[:, 0] + 5 - t).abs().mean()

    best, state, stale = 1e9, None, 0
    for _ in range(epochs):
        h.train()
        perm = torch.randperm(len(y), generator=g)
        for st in range(0, len(y), 256):
            r = perm[st : st + 256]
            m = torch.where(torch.rand(len(r), generator=g) < 0.15, 0, x[2][r])
            loss = lossf(h(x[0][r], x[1][r], m), y[r])
            opt.zero_grad()
            loss.backward()
            opt.step()
        h.eval()
        with torch.no_grad():
            vl = float(lossf(h(*vx), vy))
        if vl < best - 1e-5:
            best, state, stale = vl, {k: v.clone() for k, v in h.state_dict().items()}, 0
        else:
            stale += 1
            if stale >= 6:
                break
    h.load_state_dict(state)
    return h.eval()


def outputs(h: Any, d: tuple, kind: str) -> np.ndarray:
    import torch

    with torch.no_grad():
        o = h(*[torch.from_numpy(a) for a in d[:3]])
    return torch.softmax(o, 1).numpy() if kind == "cls" else np.expm1(o[:, 0].numpy() + 5)


def knn_votes(tr: tuple, d: tuple, k: int = 16, temp: float = 0.05) -> np.ndarray:
    probs, total = np.zeros((len(d[0]), NB)), np.zeros(len(d[0]))
    tr_models, d_models = np.array(tr[5]), np.array(d[5])
    for model in set(d[5]):
        qi, ti = np.flatnonzero(d_models == model), np.flatnonzero(tr_models == model)
        if len(ti) == 0:
            continue
        sims = d[0][qi] @ tr[0][ti].T
        kk = min(k, len(ti))
        top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]
        w = np.exp((np.take_along_axis(sims, top, 1) - 1) / temp)
        bins = length_bucket(tr[3][ti][top])
        for j in range(NB):
            probs[qi, j] = (w * (bins == j)).sum(1)
        total[qi] = w.sum(1)
    return probs / np.maximum(total[:, None], 1e-12)


def neighbour_agreement(emb: np.ndarray, row: dict[str, int], parts: dict[str, list[Sample]]) -> dict[str, Any]:
    """Same-bin rate of each held-out ShareGPT prompt's top-1 train/val neighbour, by similarity band."""
    known = [s for s in (*parts["train"], *parts["val"]) if s.source == "sharegpt"]
    test = [s for s in parts["test"] if s.source == "sharegpt"]
    sims = emb[[row[s.prompt] for s in test]] @ emb[[row[s.prompt] for s in known]].T
    top, best = sims.argmax(1), sims.max(1)
    agree = length_bucket(np.array([known[j].output_tokens for j in top])) == length_bucket(
        np.array([s.output_tokens for s in test])
    )
    out: dict[str, Any] = {}
    for lo, hi in ((0.99, 1.01), (0.95, 0.99), (0.9, 0.95), (0.8, 0.9), (0.7, 0.8), (-1.0, 0.7)):
        m = (best >= lo) & (best < hi)
        out[f"[{lo}, {hi})"] = {"n": int(m.sum()), "same_bin": float(agree[m].mean()) if m.any() else None}
    return out


def main() -> None:
    import torch

    p = benchmark_parser(__doc__)
    p.add_argument("--json", default="docs/results/data/predictor_layers.json")
    p.add_argument("--layers", default="0,1,2,3,6")
    args = p.parse_args()
    torch.set_num_threads(1)
    counter = OutputTokenCounter()
    samples: list[Sample] = [s for f in SOURCES for s in load_samples(data_file(f), counter=counter) if s.first_turn]
    parts = split_samples(samples)
    texts = sorted({s.prompt for s in samples})
    row = {t: i for i, t in enumerate(texts)}
    emb = layer_embeddings(texts)
    vocab = ["", *sorted({s.model for s in parts["train"]})]
    index = {m: i for i, m in enumerate(vocab)}

    def prep(ss: list[Sample], layer: int) -> tuple:
        idx = np.array([row[s.prompt] for s in ss])
        return (
            emb[layer][idx],
            size_features([s.prompt for s in ss]),
            np.array([index.get(s.model, 0) for s in ss]),
            np.array([s.output_tokens for s in ss]),
            np.array([s.source == "sharegpt" for s in ss]),
            [s.model for s in ss],
        )

    result: dict[str, Any] = {"split": {k: len(v) for k, v in parts.items()}, "layers": {}}
    result["neighbour_agreement_6_layers"] = neighbour_agreement(emb[6], row, parts)
    print("neighbour agreement:", result["neighbour_agreement_6_layers"], flush=True)
    for layer in map(int, args.layers.split(",")):
        t0 = time.perf_counter()
        tr, va, te = (prep(parts[k], layer) for k in ("train", "val", "test"))
        reg, cls = fit(tr, va, "reg", len(vocab)), fit(tr, va, "cls", len(vocab))
        per: dict[str, Any] = {}
        for name, d in (("val", va), ("test", te)):
            r, c, kv = outputs(reg, d, "reg"), outputs(cls, d, "cls"), knn_votes(tr, d)
            line: dict[str, Any] = {"n_sharegpt": int(d[4].sum()), "n_alpaca": int((~d[4]).sum())}
            points = {"reg": r, "cls": MID[c.argmax(1)], "knn": MID[kv.argmax(1)]}
            points |= {f"ens{a}": MID[((1 - a) * c + a * kv).argmax(1)] for a in (0.25, 0.5, 0.75)}
            for tag, pts in points.items():
                line[tag] = {
                    "sharegpt": bucket_accuracy(d[3][d[4]], pts[d[4]]),
                    "alpaca": bucket_accuracy(d[3][~d[4]], pts[~d[4]]),
                }
            line["mode_bin_share"] = {
                "sharegpt": float(np.bincount(length_bucket(d[3][d[4]])).max() / d[4].sum()),
                "alpaca": float(np.bincount(length_bucket(d[3][~d[4]])).max() / (~d[4]).sum()),
            }
            line["mae_sharegpt"] = {
                "reg": float(np.abs(r - d[3])[d[4]].mean()),
                "cls": float(np.abs(MID[c.argmax(1)] - d[3])[d[4]].mean()),
            }
            per[name] = line
            print(layer, name, json.dumps(line), flush=True)
        per["seconds"] = time.perf_counter() - t0
        result["layers"][str(layer)] = per
    write_json(result, args.json, indent=2, quiet=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
