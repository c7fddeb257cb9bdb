"""Synthetic workloads with the seed papers' published length statistics.

Data flow: a registered `SyntheticSpec` (one or more components, each a prompt and an
output length distribution) -> `generate(num_requests, seed, rate)` -> a `Workload` whose
requests carry `source` = component name, with Poisson arrivals at the paper's rate when
the paper states one. Prompt and output lengths are drawn independently: the papers publish
marginals only. Everything is deterministic under `seed`.

Every distribution is a lognormal, fitted to what the paper publishes:
- Sarathi-Serve (seed 004, Table 2) gives median and P90: mu = ln(median),
  sigma = ln(P90 / median) / z_0.9. Its "Std." column is not used: it is inconsistent with
  the percentiles (output std 101 with P90 - median = 419 tokens for openchat_sharegpt4).
    openchat_sharegpt4   prompt 1730 / 5696, output 415 / 834
    arxiv_summarization  prompt 7059 / 12985, output 208 / 371
- EconoServe (seed 001, section 2, Table 2) gives mean, min and max. The spread is not
  published: we take CV = 1 (the exponential's, the maximum-entropy law for a positive
  length with a known mean), truncate to [min, max] and solve mu so that the truncated mean
  is the published mean exactly.
    alpaca      prompt 19.31 [9, 2470],    output 58.41 [13, 292],  36 req/s
    sharegpt    prompt 161.31 [16, 3200],  output 337.99 [19, 991], 28 req/s
    bookcorpus  prompt 1952.11 (prompts cut to 2048 tokens), output 681.2 [32, 1041], 1.2 req/s
- BookCorpus prompts before the cut are shared with AccelGen: one lognormal X fitted to
  two published numbers, E[min(X, 2048)] = 1952.11 (EconoServe Table 2) and P(X > 4096) =
  0.40, i.e. AccelGen's "14% of prompts exceed 4K" (section 3, Figure 8a) divided by its 35%
  BookCorpus share; the solution is sigma ~ 0.6, median ~ 3.5K tokens. (Figure 8a's other
  bins cannot come from this mix, whose Alpaca and ShareGPT prompts are nearly all under
  512 tokens, so only its > 4K share is used.)
- AccelGen (seed 000, section 3): Alpaca (prompts up to 500), ShareGPT (up to 2K) and
  BookCorpus (up to 100K, uncut) with 35% BookCorpus, outputs capped at 2048 tokens,
  Poisson 8 req/s. The paper does not split the other 65%; we split it evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from scheduler_service.workloads.arrivals import poisson_arrivals
from scheduler_service.workloads.base import TraceRequest, Workload
from sluice.common.registry import Registry

_NORMAL = NormalDist()
_Z90 = _NORMAL.inv_cdf(0.9)
_inv_cdf = np.frompyfunc(_NORMAL.inv_cdf, 1, 1)
DEFAULT_CV = 1.0


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A lognormal length law, cut to [lo, hi]: truncated (redrawn) or clipped (piled on the bound)."""

    mu: float
    sigma: float
    lo: int = 1
    hi: int | None = None
    truncate: bool = False

    def _bounds(self) -> tuple[float, float]:
        a = (math.log(self.lo) - self.mu) / self.sigma
        b = math.inf if self.hi is None else (math.log(self.hi) - self.mu) / self.sigma
        return a, b

    def mean(self) -> float:
        a, b = self._bounds()
        cdf_a, cdf_b = _NORMAL.cdf(a), 1.0 if b == math.inf else _NORMAL.cdf(b)
        cdf_b_s = 1.0 if b == math.inf else _NORMAL.cdf(b - self.sigma)
        inner = math.exp(self.mu + self.sigma**2 / 2) * (cdf_b_s - _NORMAL.cdf(a - self.sigma))
        if self.truncate:
            return inner / (cdf_b - cdf_a)
        upper = 0.0 if self.hi is None else self.hi * (1.0 - cdf_b)
        return self.lo * cdf_a + inner + upper

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.truncate:
            a, b = self._bounds()
            # NOTE: inverse-CDF sampling inside [lo, hi] draws exactly n values (no rejection loop)
            # and piles nothing on the bounds, unlike clipping.
            low, high = _NORMAL.cdf(a), 1.0 if b == math.inf else _NORMAL.cdf(b)
            u = np.clip(rng.uniform(low, high, size=n), 1e-15, 1 - 1e-15)
            z = _inv_cdf(u).astype(np.float64)
        else:
            z = rng.standard_normal(n)
        values = np.rint(np.exp(self.mu + self.sigma * z))
        return np.clip(values, self.lo, self.hi if self.hi is not None else np.inf).astype(np.int64)

    @classmethod
    def from_median_p90(cls, median: float, p90: float, lo: int = 1, hi: int | None = None) -> LengthDist:
        return cls(math.log(median), math.log(p90 / median) / _Z90, lo, hi)

    @classmethod
    def from_mean(
        cls, mean: float, lo: int, hi: int | None, cv: float = DEFAULT_CV, truncate: bool = True
    ) -> LengthDist:
        """Solve mu so that the cut distribution's mean is `mean` (it grows with mu: bisection)."""
        sigma = math.sqrt(math.log1p(cv**2))
        low, high = math.log(lo) - 6 * sigma, math.log(hi or mean * 1e3) + 6 * sigma
        for _ in range(200):
            mid = (low + high) / 2
            if cls(mid, sigma, lo, hi, truncate).mean() < mean:
                low = mid
            else:
                high = mid
        return cls((low + high) / 2, sigma, lo, hi, truncate)


def _bookcorpus_uncut() -> tuple[float, float]:
    """(mu, sigma) of BookCorpus prompts before the 2048 cut; see the module docstring."""
    z_share = _NORMAL.inv_cdf(1.0 - 0.14 / 0.35)

    def cut_mean(sigma: float) -> float:
        mu = math.log(4096) - z_share * sigma
        return LengthDist(mu, sigma, 18, 2048).mean()

    low, high = 0.05, 3.0  # the cut mean falls as sigma grows
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if cut_mean(mid) > 1952.11 else (low, mid)
    sigma = (low + high) / 2
    return math.log(4096) - z_share * sigma, sigma


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    weight: float
    prompt: LengthDist
    output: LengthDist
    max_output: int | None = None


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    name: str
    components: tuple[Component, ...]
    citation: str
    published: dict[str, float] = field(default_factory=dict)  # the paper's numbers the generator reproduces
    default_rate: float | None = None  # Poisson rate the paper used, req/s

    def generate(self, num_requests: int, seed: int = 0, rate: float | None = None) -> Workload:
        lengths_seed, arrivals_seed = np.random.SeedSequence(seed).spawn(2)
        rng = np.random.default_rng(lengths_seed)
        weights = np.array([c.weight for c in self.components])
        picks = rng.choice(len(self.components), size=num_requests, p=weights / weights.sum())
        prompts = np.zeros(num_requests, dtype=np.int64)
        outputs = np.zeros(num_requests, dtype=np.int64)
        for k, comp in enumerate(self.components):
            mask = picks == k
            prompts[mask] = comp.prompt.sample(rng, int(mask.sum()))
            drawn = comp.output.sample(rng, int(mask.sum()))
            outputs[mask] = drawn if comp.max_output is None else np.minimum(drawn, comp.max_output)
        rate = self.default_rate if rate is None else rate
        times = poisson_arrivals(num_requests, rate, arrivals_seed) if rate is not None else [None] * num_requests
        requests = [
            TraceRequest(
                f"{self.name}-{i}", None if t is None else float(t), int(p), int(o), source=self.components[c].name
            )
            for i, (t, p, o, c) in enumerate(zip(times, prompts, outputs, picks, strict=True))
        ]
        return Workload(self.name, requests, self._metadata(num_requests, seed, rate))

    def _metadata(self, num_requests: int, seed: int, rate: float | None) -> dict[str, Any]:
        return {
            "format": "synthetic",
            "generator": self.name,
            "citation": self.citation,
            "published": dict(self.published),
            "num_requests": num_requests,
            "seed": seed,
            "arrivals": f"poisson(rate={rate:g})" if rate is not None else None,
            "history": [f"synthetic {self.name}(n={num_requests}, seed={seed})"],
        }


SYNTHETIC_WORKLOADS: Registry[SyntheticSpec] = Registry("synthetic workload")


def _register(spec: SyntheticSpec) -> None:
    SYNTHETIC_WORKLOADS.register(spec.name)(spec)


_ECONO = "EconoServe (seed 001), section 2, Table 2"
_ALPACA_OUT = LengthDist.from_mean(58.41, 13, 292)
_SHAREGPT_OUT = LengthDist.from_mean(337.99, 19, 991)
_BOOK_OUT = LengthDist.from_mean(681.2, 32, 1041)
_BOOK_MU, _BOOK_SIGMA = _bookcorpus_uncut()

ECONOSERVE_ALPACA = Component("alpaca", 1.0, LengthDist.from_mean(19.31, 9, 2470), _ALPACA_OUT)
ECONOSERVE_SHAREGPT = Component("sharegpt", 1.0, LengthDist.from_mean(161.31, 16, 3200), _SHAREGPT_OUT)
ECONOSERVE_BOOKCORPUS = Component("bookcorpus", 1.0, LengthDist(_BOOK_MU, _BOOK_SIGMA, 18, 2048), _BOOK_OUT)

_register(
    SyntheticSpec("econoserve-alpaca", (ECONOSERVE_ALPACA,), _ECONO, {"prompt_mean": 19.31, "output_mean": 58.41}, 36.0)
)
_register(
    SyntheticSpec(
        "econoserve-sharegpt", (ECONOSERVE_SHAREGPT,), _ECONO, {"prompt_mean": 161.31, "output_mean": 337.99}, 28.0
    )
)
_register(
    SyntheticSpec(
        "econoserve-bookcorpus", (ECONOSERVE_BOOKCORPUS,), _ECONO, {"prompt_mean": 1952.11, "output_mean": 681.2}, 1.2
    )
)

_SARATHI = "Sarathi-Serve (seed 004), section 5, Table 2"
_register(
    SyntheticSpec(
        "sarathi-openchat-sharegpt4",
        (
            Component(
                "openchat_sharegpt4", 1.0, LengthDist.from_median_p90(1730, 5696), LengthDist.from_median_p90(415, 834)
            ),
        ),
        _SARATHI,
        {"prompt_median": 1730, "prompt_p90": 5696, "output_median": 415, "output_p90": 834},
    )
)
_register(
    SyntheticSpec(
        "sarathi-arxiv-summarization",
        (
            Component(
                "arxiv_summarization",
                1.0,
                LengthDist.from_median_p90(7059, 12985),
                LengthDist.from_median_p90(208, 371),
            ),
        ),
        _SARATHI,
        {"prompt_median": 7059, "prompt_p90": 12985, "output_median": 208, "output_p90": 371},
    )
)

ACCELGEN_MAX_OUTPUT = 2048
ACCELGEN_BOOKCORPUS_SHARE = 0.35
_register(
    SyntheticSpec(
        "accelgen-mix",
        (
            Component("alpaca", 0.325, LengthDist.from_mean(19.31, 9, 500), _ALPACA_OUT, ACCELGEN_MAX_OUTPUT),
            Component("sharegpt", 0.325, LengthDist.from_mean(161.31, 16, 2048), _SHAREGPT_OUT, ACCELGEN_MAX_OUTPUT),
            Component(
                "bookcorpus",
                ACCELGEN_BOOKCORPUS_SHARE,
                LengthDist(_BOOK_MU, _BOOK_SIGMA, 18, 100_000),
                _BOOK_OUT,
                ACCELGEN_MAX_OUTPUT,
            ),
        ),
        "AccelGen (seed 000), section 3 (data sets, Figure 8a) and section 6.1",
        {
            "bookcorpus_share": ACCELGEN_BOOKCORPUS_SHARE,
            "share_prompts_over_4k": 0.14,
            "max_output": ACCELGEN_MAX_OUTPUT,
        },
        8.0,
    )
)


def generate_synthetic(name: str, num_requests: int, seed: int = 0, rate: float | None = None) -> Workload:
    return SYNTHETIC_WORKLOADS.get(name).generate(num_requests, seed, rate)
