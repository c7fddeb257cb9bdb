"""Fitted cost model ("fitted"): a linear model of our own worker, regressed on `sluice profile` output.

Data flow: `WorkerProfile` JSON (profile_schema.py: step samples, each a full BatchShape with
its median time, and swap samples) -> feature rows -> non-negative least squares -> one
coefficient per feature. `iteration_time(shape)` is then a dot product of the same features.

Features of a BatchShape (`step_features`), each the work one kind of kernel scales with:

    const               per-step fixed cost: launches, sampling, Python, reading the weights once
    prefill_tokens      GEMM rows of prefill chunks (projections and MLP)
    num_decodes         GEMM rows of decodes (kept apart: decode batches run other kernels)
    prefill_attention   sum of chunk x (prefix + chunk / 2): causal attention FLOPs / (4 d h)
    decode_context      decode_context_sum: KV tokens decode attention reads
    num_seqs            per-sequence costs (metadata, LM head row, sampling)
    gemm_shortfall      max(0, knee - tokens): on a GPU a step's GEMMs cost the weight reads
                        until enough rows make them compute bound (the roofline's ridge); with
                        coefficient = the per-row cost, time stays flat below the knee

This is the form of SCLS's serving-time estimator (section 4.2, `p1 N L + p2 N + p3 L + p4`)
extended to mixed chunked batches. Coefficients are constrained non-negative (every feature
is work, none can save time), solved by Lawson and Hanson's active-set NNLS (Solving Least
Squares Problems, 1974, ch. 23), on rows weighted by 1 / measured time so that the fit
minimises relative error: small decode steps matter as much as big prefills. The knee is
the one of KNEE_CANDIDATES (0: no hinge) whose fit has the smallest relative error. On
step times priced by the H100 analytic and Vidur models at the GPU profile grid (a stand-in
until a measured GPU profile exists: `benchmarks/costmodel_gpu_fit.py --proxy`), the hinge
(knee 192 and 128 rows) cut the held-out median error from 7.5% and 5.2% to 0.2% and 2.7%.

Swaps: `seconds = a + bytes / bandwidth` per direction ("out" GPU->CPU, "in") and per
int8/fp16 KV, fitted the same way on the profile's swap samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from scheduler_service.costmodel.base import COST_MODELS, CostModel, HardwareSpec
from scheduler_service.costmodel.presets import HARDWARE_PRESETS
from sluice.contract.profile import BatchShape, StepSample, SwapSample, WorkerProfile

FEATURES = (
    "const", "prefill_tokens", "num_decodes", "prefill_attention", "decode_context", "num_seqs", "gemm_shortfall"
)  # fmt: skip
KNEE_CANDIDATES = (0, 32, 64, 128, 192, 256, 384, 512)  # GEMM rows


def step_features(shape: BatchShape, knee: int = 0) -> tuple[float, ...]:
    prefill_tokens, attention = 0, 0.0
    for chunk, prefix in shape.prefill_chunks:
        prefill_tokens += chunk
        attention += chunk * (prefix + 0.5 * chunk)
    shortfall = max(0, knee - prefill_tokens - shape.num_decodes)
    return (1.0, prefill_tokens, shape.num_decodes, attention, shape.decode_context_sum, shape.num_seqs, shortfall)


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # NOTE: features span 1 to 1e7; unit columns keep the pivoting well conditioned
    x, passive = np.zeros(a.shape[1]), np.zeros(a.shape[1], dtype=bool)
    for _ in range(3 * a.shape[1]):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        x, passive = _solve_passive(a, b, x, passive)
    return x / scale


def _solve_passive(a: np.ndarray, b: np.ndarray, x: np.ndarray, passive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on the passive set, stepping back whenever a coefficient would go negative."""
    while passive.any():
        z = np.zeros_like(x)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        if (z[passive] > 0).all():
            return z, passive
        blocked = passive & (z <= 0)
        alpha = np.min(x[blocked] / (x[blocked] - z[blocked]))
        x = x + alpha * (z - x)
        passive = passive & (x > 1e-15)
        x[~passive] = 0.0
    return x, passive


def fit_relative(rows: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of rows @ coef vs times."""
    if np.any(times <= 0):
        raise ValueError("every profiled time must be positive")
    return nnls(rows / times[:, None], np.ones_like(times))


@dataclass(frozen=True, slots=True)
class FitReport:
    coefficients: dict[str, float]
    relative_errors: list[float]  # (predicted - measured) / measured, one per step sample
    mape: float  # mean absolute relative error over the step samples
    swap_mape: float | None  # same over the swap samples; None when the profile has none
    knee: int = 0  # GEMM rows of the fitted roofline hinge (0: none)


@dataclass(frozen=True, slots=True)
class HoldoutReport:
    """Errors on step samples the model was not fitted on."""

    relative_errors: list[float]  # (predicted - measured) / measured, one per held-out sample
    median: float  # of the absolute relative errors
    mean: float
    p90: float
    num_fitted: int


class SwapFit:
    """seconds = fixed + bytes x per_byte, for one (direction, int8) pair."""

    def __init__(self, samples: list[SwapSample]) -> None:
        rows = np.array([(1.0, s.bytes) for s in samples], dtype=float)
        self.fixed, self.per_byte = (float(v) for v in fit_relative(rows, np.array([s.time_s for s in samples])))

    def time(self, num_bytes: int) -> float:
        return self.fixed + num_bytes * self.per_byte if num_bytes else 0.0


def hardware_for(device: str) -> HardwareSpec | None:
    """The preset GPU a profile's device string names ("cuda:0 (NVIDIA H100 80GB HBM3)"), if any."""
    text = device.lower().replace(" ", "")
    aliases = {"h100": "h100-80g", "h200": "h200", "a100": "a100-80g", "a40": "a40", "v100": "v100-32g"}
    return next((HARDWARE_PRESETS[key] for alias, key in aliases.items() if alias in text), None)


@COST_MODELS.register("fitted")
class FittedCostModel(CostModel):
    name = "fitted"

    def __init__(self, profile: WorkerProfile, hardware: HardwareSpec | None = None, int8_swaps: bool = False) -> None:
        if not profile.steps:
            raise ValueError("the worker profile has no step samples to fit")
        hardware = hardware or hardware_for(profile.device) or HardwareSpec(profile.device, 0.0, 0.0, 0.0, 0.0)
        super().__init__(profile.model, hardware)
        self.profile, self.int8_swaps = profile, int8_swaps
        self._times = np.array([s.time_s for s in profile.steps])
        self.knee, self.coef, self._rows = self._fit_steps(profile.steps, self._times)
        self._swaps = self._fit_swaps(profile.swaps)

    @classmethod
    def from_file(cls, path: str | Path, hardware: HardwareSpec | None = None) -> FittedCostModel:
        return cls(WorkerProfile.load(path), hardware)

    @staticmethod
    def _fit_steps(steps: list[StepSample], times: np.ndarray) -> tuple[int, tuple[float, ...], np.ndarray]:
        """(knee, coefficients, feature rows) of the knee whose fit has the smallest mean relative error."""
        best: tuple[float, int, tuple[float, ...], np.ndarray] | None = None
        for knee in KNEE_CANDIDATES:
            rows = np.array([step_features(s.shape, knee) for s in steps], dtype=float)
            coef = fit_relative(rows, times)
            error = float(np.mean(np.abs(rows @ coef - times) / times))
            if best is None or error < best[0] - 1e-12:
                best = (error, knee, tuple(float(c) for c in coef), rows)
        assert best is not None
        return best[1], best[2], best[3]

    def holdout(self, every: int = 4) -> HoldoutReport:
        """Refits on all step samples but every `every`-th and prices those (deterministic)."""
        held = self.profile.steps[::every]
        fitted = [s for i, s in enumerate(self.profile.steps) if i % every]
        model = FittedCostModel(replace(self.profile, steps=fitted, swaps=[]), self.hardware)
        errors = np.array([(model.iteration_time(s.shape) - s.time_s) / s.time_s for s in held])
        absolute = np.abs(errors)
        return HoldoutReport(
            relative_errors=errors.tolist(),
            median=float(np.median(absolute)),
            mean=float(np.mean(absolute)),
            p90=float(np.percentile(absolute, 90)),
            num_fitted=len(fitted),
        )

    @staticmethod
    def _fit_swaps(samples: list[SwapSample]) -> dict[tuple[str, bool], SwapFit]:
        groups: dict[tuple[str, bool], list[SwapSample]] = {}
        for s in samples:
            groups.setdefault((s.direction, bool(s.int8)), []).append(s)
        return {key: SwapFit(group) for key, group in groups.items()}

    def swap_time(self, num_bytes: int, direction: str = "out") -> float:
        fit = self._swaps.get((direction, self.int8_swaps))
        if fit is not None:
            return fit.time(num_bytes)
        if num_bytes and not self.hardware.pcie_bandwidth:
            raise ValueError(f"profile has no {direction!r} swap samples and {self.hardware.name!r} no PCIe figure")
        return super().swap_time(num_bytes)

    def iteration_time(self, shape: BatchShape) -> float:
        swaps = self.swap_time(shape.swap_out_bytes, "out") + self.swap_time(shape.swap_in_bytes, "in")
        if shape.num_tokens == 0:
            return swaps
        return sum(c * f for c, f in zip(self.coef, step_features(shape, self.knee), strict=True)) + swaps

    def fit_report(self) -> FitReport:
        errors = (self._rows @ np.array(self.coef) - self._times) / self._times
        swap_errors = [
            (self._swaps[(s.direction, bool(s.int8))].time(s.bytes) - s.time_s) / s.time_s for s in self.profile.swaps
        ]
        return FitReport(
            coefficients=dict(zip(FEATURES, self.coef, strict=True)),
            relative_errors=errors.tolist(),
            mape=float(np.mean(np.abs(errors))),
            swap_mape=float(np.mean(np.abs(swap_errors))) if swap_errors else None,
            knee=self.knee,
        )
