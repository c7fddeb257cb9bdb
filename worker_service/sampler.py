"""Turns the logits of the rows that sample this step into one token id each.

    logits [S, V] float32 -> penalties -> min_tokens (EOS masked) -> greedy rows: argmax
                                                                   -> other rows: / temperature
                                                                      -> top-k -> top-p -> min-p
                                                                      -> softmax -> draw

A draw is `argmax(probs / q)` with q ~ Exponential(1) per token (the Gumbel-max trick in
another form), so it needs no cumulative sums and takes its randomness as one tensor per
row. A request with a seed owns a `torch.Generator`, used only for its own row, so its
tokens are the same whatever else is in the batch; unseeded rows share the engine's
generator. Stop strings and EOS detection stay with the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.contract.sampling import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: Sequence[int]  # all known tokens: prompt, then output
    num_output_tokens: int
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[len(self.token_ids) - self.num_output_tokens :]


def needs_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row [V]: repetition over prompt and output (as transformers), presence and
    frequency over output only (as OpenAI)."""
    p, vocab = row.params, logits.shape[-1]
    if p.repetition_penalty != 1.0 and row.token_ids:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor(list(row.token_ids), device=logits.device)] = True
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    out = list(row.output_token_ids)
    if out and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (0 = off) then top-p over the renormalised survivors; the best token
    always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], device: torch.device, seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        return self.sample(logits, rows).tolist()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The tokens as a device tensor: nothing here waits for the device (the caller's
        `tolist()` is the step's one synchronisation)."""
        logits = self._prepare(logits.float(), rows)
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if len(random_rows) == len(rows):
            return self._draw(logits, rows)
        tokens = logits.argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            tokens[idx] = self._draw(logits[idx], [rows[i] for i in random_rows])
        return tokens

    def _prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if needs_penalties(row.params):
                logits[i] = apply_penalties(logits[i], row)
            if row.num_output_tokens < row.params.min_tokens:
                banned = list(self.eos_token_ids) + list(row.params.stop_token_ids)
                if banned:
                    logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=logits.device)

        logits = logits / column([r.params.temperature for r in rows], torch.float32)[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            top_k = column([r.params.top_k for r in rows], torch.long)
            logits = mask_top_k_top_p(logits, top_k, column([r.params.top_p for r in rows], torch.float32))
        if any(r.params.min_p > 0.0 for r in rows):
            logits = mask_min_p(logits, column([r.params.min_p for r in rows], torch.float32))
        probs = logits.softmax(dim=-1)
        return (probs / self._exponential(probs, rows)).argmax(dim=-1)

    def _exponential(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        q = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            return q.exponential_(generator=self.generator)
        if shared:
            q[shared] = torch.empty((len(shared), probs.shape[-1]), device=probs.device).exponential_(
                generator=self.generator
            )
        for i, row in enumerate(rows):
            if row.generator is not None:
                q[i].exponential_(generator=row.generator)
        return q
