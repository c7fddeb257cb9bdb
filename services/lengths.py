"""The simulator's `--length-source predictor[:DIR]`: the real predictor's output lengths for a
trace, made once before the run and handed to the cluster as a table (TableLengths).

    traces with prompt text (sharegpt, alpaca-eval, codealpaca, Sluice JSONL with text):
        predictor_service.trace.predict_prompts over the prompts, batched and cached on disk,
        per served model (the model that wrote the trace's answers, where the trace says)
    traces without text (Azure, Mooncake, vidur CSVs, synthetic):
        the predictor's own held-out error model (DIR/error_model.json): for each request a
        prediction drawn from the residuals the predictor made on held-out prompts of a similar
        true length (the empirical distribution, not a symmetric Gaussian)

The predictor counts lengths in its tokenizer's tokens (the MiniLM word pieces, which the demo
models use too); `sluice simulate` counts a text trace with that tokenizer when this source is
chosen, so predicted and true lengths share a unit.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from scheduler_service.cluster.lengths import TableLengths
from scheduler_service.sim.workloads import Workload

PREFIX = "predictor"


def is_predictor_source(spec: str) -> bool:
    return spec == PREFIX or spec.startswith(PREFIX + ":")


def model_dir_of(spec: str) -> Path | None:
    """`predictor` -> None (the committed model), `predictor:DIR` -> DIR."""
    _, _, rest = spec.partition(":")
    return Path(rest) if rest else None


def served_model_of(source: str) -> str:
    """The model whose answers a trace records, named as the predictor knows it ("" = unknown)."""
    if source.startswith("sharegpt"):
        return "chatgpt-sharegpt"
    if source.startswith("alpaca-eval/"):
        return source.split("/", 1)[1]
    if source.startswith("codealpaca"):
        return "text_davinci_003"  # Code Alpaca's answers were written by text-davinci-003 (its README)
    return ""


def predictor_lengths(spec: str, workload: Workload, seed: int = 0, progress: bool = True) -> TableLengths:
    """Predicted output tokens for every request of `workload` (see the module docstring)."""
    model_dir = model_dir_of(spec)
    requests = workload.requests
    if requests and all(r.prompt_text for r in requests):
        return TableLengths(_from_text(model_dir, workload, progress), name="predictor")
    return TableLengths(_from_error_model(model_dir, workload, seed), name="predictor-error-model")


def _from_text(model_dir: Path | None, workload: Workload, progress: bool) -> dict[str, int]:
    from predictor_service.trace import predict_prompts

    by_model: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(workload.requests):
        by_model[served_model_of(r.source)].append(i)
    table: dict[str, int] = {}
    for served, indexes in by_model.items():
        texts = [workload.requests[i].prompt_text or "" for i in indexes]
        for i, pred in zip(indexes, predict_prompts(model_dir, texts, served, progress=progress), strict=True):
            table[workload.requests[i].request_id] = pred.tokens
    return table


def _from_error_model(model_dir: Path | None, workload: Workload, seed: int) -> dict[str, int]:
    from predictor_service import artefacts
    from sluice.contract.lengths import LengthErrorModel

    path = Path(model_dir or artefacts.default_model_dir()) / "error_model.json"
    errors = LengthErrorModel.load(path)
    rng = np.random.default_rng(seed)
    return {r.request_id: errors.sample(max(1, r.output_tokens), rng).tokens for r in workload.requests}
