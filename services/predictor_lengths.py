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

from scheduler_service.cluster.length_sources import LengthSource, TableLengths
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.workloads import Workload

PREFIX = "predictor"
ONLINE = "predictor-online"


def is_predictor_source(spec: str) -> bool:
    return spec == PREFIX or spec.startswith(PREFIX + ":")


def is_online_source(spec: str) -> bool:
    """`predictor-online[:DIR]`: the predictor in the run, its history learning (OnlinePredictorLengths)."""
    return spec == ONLINE or spec.startswith(ONLINE + ":")


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


class OnlinePredictorLengths(LengthSource):
    """The real predictor inside the run: each request is predicted when it is submitted, from
    the history as it is then, and every request that ends on its own (or at max_tokens) adds
    its true length to that history, as the live service's predictor does (and ALISE's
    Algorithm 1, line 12). The prompts are embedded once before the run (the costly part);
    head, retrieval and blend run per request."""

    name = "predictor-online"  # type: ignore[assignment]

    def __init__(self, model_dir: Path | None, workload: Workload, progress: bool = True) -> None:
        from predictor_service.predictor import LengthPredictor

        self.predictor = LengthPredictor(model_dir)  # the served seed history, this run's to grow
        reqs = [r for r in workload.requests if r.prompt_text]
        texts = [r.prompt_text or "" for r in reqs]
        rows = []
        batch = 64
        for lo in range(0, len(texts), batch):
            rows.append(self.predictor.embed(texts[lo : lo + batch]))
            if progress:
                print(f"embedded {min(lo + batch, len(texts))}/{len(texts)} prompts", flush=True)
        emb = np.concatenate(rows) if rows else np.zeros((0, 0))
        self._rows = {
            r.request_id: (emb[i], r.prompt_text or "", served_model_of(r.source)) for i, r in enumerate(reqs)
        }
        self.num_observed = 0

    def predict(self, request: Request) -> int | None:
        row = self._rows.get(request.request_id)
        if row is None:
            return None
        emb, text, model = row
        return self.predictor.predict_embedded(emb[None, :], [text], [model])[0].tokens

    def observe(self, request: Request) -> None:
        row = self._rows.get(request.request_id)
        # NOTE: only a request that stopped on its own: a length cut at max_tokens is a lower
        # bound and an abort says nothing (the live predictor's rule)
        if row is None or request.status is not RequestStatus.FINISHED_STOPPED:
            return
        emb, _, model = row
        self.predictor.observe(emb, model, request.num_output_tokens)
        self.num_observed += 1


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
    from sluice.contract.length_prediction import LengthErrorModel

    path = Path(model_dir or artefacts.default_model_dir()) / "error_model.json"
    errors = LengthErrorModel.load(path)
    rng = np.random.default_rng(seed)
    return {r.request_id: errors.sample(max(1, r.output_tokens), rng).tokens for r in workload.requests}
