"""The predictor's output lengths for a recorded trace, for the simulator's
`--length-source predictor[:DIR]` and `predictor-online[:DIR]`. Plain data in (request id,
prompt text, the trace's source name, true length), plain data out, so the scheduler side
stays free of the predictor and this side free of the scheduler.

    traces with prompt text (sharegpt, alpaca-eval, codealpaca, Sluice JSONL with text):
        predict_trace -> trace.predict_prompts over the prompts, batched and cached on disk,
        per served model (the model that wrote the trace's answers, where the trace says)
    traces without text (Azure, Mooncake, vidur CSVs, synthetic):
        error_model_lengths -> the predictor's own held-out error model (DIR/error_model.json):
        for each request a prediction drawn from the residuals the predictor made on held-out
        prompts of a similar true length (the empirical distribution, not a symmetric Gaussian)
    in the run, learning (predictor-online):
        OnlineTracePredictor -> prompts embedded once before the run; head, retrieval and blend
        per request when it is submitted; the history learns each true length it is told

The predictor counts lengths in its tokenizer's tokens (the MiniLM word pieces, which the demo
models use too); `sluice simulate` counts a text trace with that tokenizer when these sources
are chosen, so predicted and true lengths share a unit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class TracePrompt:
    request_id: str
    text: str
    source: str  # the trace's source name (which model wrote its answers: served_model_of)


def served_model_of(source: str) -> str:
    """The model whose answers a trace records, named as the predictor knows it ("" = unknown)."""
    if source.startswith("sharegpt"):
        return "chatgpt-sharegpt"
    if source.startswith("alpaca-eval/"):
        return source.split("/", 1)[1]
    if source.startswith("codealpaca"):
        return "text_davinci_003"  # Code Alpaca's answers were written by text-davinci-003 (its README)
    return ""


def predict_trace(model_dir: Path | None, prompts: Sequence[TracePrompt], progress: bool = True) -> dict[str, int]:
    """Predicted output tokens by request id, one cached batch run per served model."""
    from predictor_service.trace import predict_prompts

    by_model: dict[str, list[TracePrompt]] = defaultdict(list)
    for p in prompts:
        by_model[served_model_of(p.source)].append(p)
    table: dict[str, int] = {}
    for served, group in by_model.items():
        texts = [p.text for p in group]
        for p, pred in zip(group, predict_prompts(model_dir, texts, served, progress=progress), strict=True):
            table[p.request_id] = pred.tokens
    return table


def error_model_lengths(model_dir: Path | None, true_lengths: Mapping[str, int], seed: int) -> dict[str, int]:
    """A prediction by request id drawn from the predictor's held-out errors at each true
    length (in the mapping's order, so one seed gives one table)."""
    from predictor_service import artefacts
    from sluice.contract.length_prediction import LengthErrorModel

    path = Path(model_dir or artefacts.default_model_dir()) / "error_model.json"
    errors = LengthErrorModel.load(path)
    rng = np.random.default_rng(seed)
    return {rid: errors.sample(max(1, tokens), rng).tokens for rid, tokens in true_lengths.items()}


class OnlineTracePredictor:
    """The real predictor inside a simulated run: `predict` answers from the history as it is
    then, `observe` adds a true length to it, as the live service's predictor does (and ALISE's
    Algorithm 1, line 12). The prompts are embedded once before the run (the costly part)."""

    def __init__(self, model_dir: Path | None, prompts: Sequence[TracePrompt], progress: bool = True) -> None:
        from predictor_service.predictor import LengthPredictor

        self.length_predictor = LengthPredictor(model_dir)  # the served seed history, this run's to grow
        texts = [p.text for p in prompts]
        rows = []
        batch = 64
        for lo in range(0, len(texts), batch):
            rows.append(self.length_predictor.embed(texts[lo : lo + batch]))
            if progress:
                print(f"embedded {min(lo + batch, len(texts))}/{len(texts)} prompts", flush=True)
        emb = np.concatenate(rows) if rows else np.zeros((0, 0))
        self._rows = {p.request_id: (emb[i], p.text, served_model_of(p.source)) for i, p in enumerate(prompts)}
        self.num_observed = 0

    def predict(self, request_id: str) -> int | None:
        row = self._rows.get(request_id)
        if row is None:
            return None
        emb, text, model = row
        return self.length_predictor.predict_embedded(emb[None, :], [text], [model])[0].tokens

    def observe(self, request_id: str, output_tokens: int) -> None:
        row = self._rows.get(request_id)
        if row is None:
            return
        emb, _, model = row
        self.length_predictor.observe(emb, model, output_tokens)
        self.num_observed += 1
