"""SLO-aware admission: will a new request meet its SLOs on a worker, given that worker's queue
and measured speed? Pure (no clock, no I/O): the live scheduler asks it for every request.

    StepSpeed        seconds per step = base_s + per_token_s x tokens scheduled in the step
    SpeedFit         that line fitted online from the steps a worker ran (least squares over
                     the last `window` steps), starting from a prior (the cost model's)
    QueueView        what a worker holds: running requests' output tokens left, waiting
                     requests' prompt and output tokens, its max_num_seqs and token budget
    estimate()       TTFT and mean TBT the new request would see there
    decide()         admit, or refuse naming the SLO that cannot be met

The estimate, for a worker with R running and Q waiting requests and S seats (max_num_seqs):
the new request is prefilled once it has a seat and the prompts ahead of it are computed, so

    TTFT = steps in flight + seat_steps x step(decode batch) + prefill_steps x base_s
           + per_token_s x (prompts ahead + its own + prefill_steps x decode batch)

where seat_steps is 0 while R + Q < S, else the decode steps until enough running requests
end (the k-th shortest remainder); and once it decodes in a batch of B = min(S, R + Q + 1),
each step carries B decode tokens plus the prompts of the requests that replace the ones that
end (B x prompt/output tokens per step, in steady state), so

    mean TBT = base_s + per_token_s x B x (1 + mean prompt / mean output)

plus, with requests running, per_token_s x the prompts pending (its own included) / mean
output tokens: they land in the next step, one gap of each running request's mean. While a
batch fills up (the recent steps carried more prompt tokens than even a full batch's
turnover, the largest batch the TBT SLO allows) the prompts pending count as every step's
load, base_s + per_token_s x (B + prompts pending), which paces the ramp; the lone prompts
of a light load do not.

A request whose SLOs the estimate cannot meet is refused: admitting it would miss them and
slow every request already admitted. The TBT rule is what bounds the batch: it derives the
number of sequences a worker can serve within the SLO from its measured speed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepSpeed:
    base_s: float  # seconds of a step whatever it holds
    per_token_s: float  # seconds per token scheduled in it

    def step_s(self, tokens: float) -> float:
        return self.base_s + self.per_token_s * tokens

    def max_batch(self, tbt_s: float, prompt_per_output: float = 0.0) -> int:
        """The largest decode batch whose steady-state step (estimate's TBT rule) fits tbt_s."""
        if self.per_token_s <= 0:
            return 1 << 30
        return max(0, math.floor((tbt_s - self.base_s) / (self.per_token_s * (1.0 + prompt_per_output))))


PREFILL_SMOOTHING = 0.3  # weight of the latest step in SpeedFit.prefill_per_step


class SpeedFit:
    """A worker's StepSpeed, fitted by least squares over its last `window` steps (tokens,
    seconds). With fewer than `min_samples` steps the prior is scaled to what they took; with
    steps all of one size (the slope cannot be told) the prior's slope is kept and only the base
    is fitted."""

    def __init__(self, prior: StepSpeed, window: int = 256, min_samples: int = 8) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fitted: StepSpeed | None = None
        self.overhead_s = 0.0  # mean seconds a step takes beyond the worker's own (the wire, the scheduler)
        self.prefill_per_step = 0.0  # prompt tokens of the recent steps (moving average)

    def add(self, tokens: int, seconds: float, seen_s: float | None = None, prefill: int = 0) -> None:
        """A step of `tokens` (`prefill` of them prompt tokens) that the worker says took
        `seconds`; `seen_s`: how long it took as the scheduler saw it (its overhead is
        averaged and added to every step)."""
        self.prefill_per_step += PREFILL_SMOOTHING * (prefill - self.prefill_per_step)
        if tokens > 0 and seconds > 0 and math.isfinite(seconds):
            self._samples.append((tokens, seconds))
            self._fitted = None
            if seen_s is not None and math.isfinite(seen_s):
                self.overhead_s += 0.05 * (max(0.0, seen_s - seconds) - self.overhead_s)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def speed(self) -> StepSpeed:
        speed = self._speed()
        return StepSpeed(speed.base_s + self.overhead_s, speed.per_token_s) if self.overhead_s else speed

    def _speed(self) -> StepSpeed:
        if not self._samples:
            return self.prior
        if len(self._samples) < self.min_samples:
            # NOTE: the prior's shape, scaled to the steps seen: a cost model off by 10x (the
            # analytic roofline of a CPU, an emulated device) is corrected by the first step.
            predicted = sum(self.prior.step_s(x) for x, _ in self._samples)
            ratio = sum(y for _, y in self._samples) / predicted if predicted > 0 else 1.0
            return StepSpeed(self.prior.base_s * ratio, self.prior.per_token_s * ratio)
        if self._fitted is None:
            self._fitted = _least_squares(self._samples, self.prior)
        return self._fitted


def _least_squares(samples: Sequence[tuple[int, float]], prior: StepSpeed) -> StepSpeed:
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples) / n
    slope = prior.per_token_s
    if var >= 1.0:
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in samples) / n / var)
    base = mean_y - slope * mean_x
    if base < 0:  # NOTE: a line through the steps' mean that starts below zero: all of it per token
        base, slope = 0.0, mean_y / mean_x
    return StepSpeed(base, slope)


@dataclass(frozen=True, slots=True)
class QueueView:
    running_left: tuple[int, ...] = ()  # output tokens each running request still produces
    running_prefill: int = 0  # prompt tokens the running requests still compute
    waiting_prompts: tuple[int, ...] = ()  # tokens each waiting request computes before its first token
    waiting_outputs: tuple[int, ...] = ()  # output tokens each waiting request will produce
    max_num_seqs: int = 256
    token_budget: int = 8192
    # (tokens, seconds since it started) of each step sent and not answered yet, oldest first:
    # they run before any new plan
    in_flight: tuple[tuple[int, float], ...] = ()
    recent_prefill: float = 0.0  # prompt tokens per step lately (SpeedFit.prefill_per_step)


@dataclass(frozen=True, slots=True)
class Estimate:
    ttft_s: float
    tbt_s: float
    batch: int  # the decode batch the request would run in


def estimate(
    view: QueueView, prompt_tokens: int, output_tokens: int, speed: StepSpeed, tbt_s: float | None = None
) -> Estimate:
    """TTFT and mean TBT of a new request placed behind `view`'s queue (module docstring).
    `tbt_s`: the TBT the batch is held to, whose largest batch's turnover tells a filling batch
    from the lone prompts of a light load.
    NOTE: a step in flight that has run longer than the speed says is not taken as a slower
    worker: on a shared machine one step held up by the OS made every estimate explode and
    refused requests at light load; the speed fit follows a lasting change within steps."""
    running, waiting = len(view.running_left), len(view.waiting_prompts)
    seats = max(1, view.max_num_seqs)
    batch = min(seats, running + waiting + 1)
    decoding_meanwhile = min(seats, running + waiting)
    outputs = [*view.waiting_outputs, output_tokens]
    mean_output = max(1.0, sum(outputs) / len(outputs))
    departures_needed = running + waiting + 1 - seats
    if departures_needed <= 0:
        seat_steps = 0.0
    elif departures_needed <= running:
        seat_steps = float(sorted(view.running_left)[departures_needed - 1])
    else:
        waves = math.ceil((departures_needed - running) / seats)
        seat_steps = max(view.running_left, default=0) + waves * mean_output
    prefill = view.running_prefill + sum(view.waiting_prompts) + prompt_tokens
    prefill_steps = max(1, math.ceil(prefill / max(1, view.token_budget)))
    ttft = (
        sum(max(0.0, speed.step_s(tokens) - elapsed) for tokens, elapsed in view.in_flight)
        + seat_steps * speed.step_s(decoding_meanwhile)
        + prefill_steps * speed.base_s
        + speed.per_token_s * (prefill + prefill_steps * decoding_meanwhile)
    )
    prompts = [*view.waiting_prompts, prompt_tokens]
    prompt_per_output = (sum(prompts) / len(prompts)) / mean_output
    # NOTE: prompts come in lumps. The prompts pending now land in the next step: a running
    # request's mean gap takes that lump spread over the tokens it has left (a lone lump at
    # light load passes). While a batch fills up, though, every step carries the prompts
    # admitted during the one before, above the steady turnover (the recent steps show it):
    # then the lump counts as every step's, which paces the ramp.
    turnover = batch * prompt_per_output
    tbt = speed.step_s(batch + turnover)
    if view.running_left:
        # NOTE: spread over a request's whole output (its mean gap is over all of them), not
        # over what is left: one near its end barely notices a lump
        pending = view.running_prefill + sum(view.waiting_prompts)
        tbt += speed.per_token_s * (pending + prompt_tokens) / mean_output
        full_turnover = speed.max_batch(tbt_s, prompt_per_output) * prompt_per_output if tbt_s else turnover
        if view.recent_prefill > max(turnover, full_turnover):
            tbt = max(tbt, speed.step_s(batch + max(turnover, pending)))
    return Estimate(ttft, tbt, batch)


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    reason: str  # "" when admitted, else the SLO that cannot be met: "ttft" or "tbt"
    estimate: Estimate | None = None

    def describe(self, ttft_s: float | None, tbt_s: float | None, headroom: float = 1.0) -> str:
        est = self.estimate
        if self.reason == "cold":
            return f"SLO cannot be met now: the workers' speed is being measured (at most {COLD_SEQS} requests each)"
        if est is None or self.admit:
            return "admitted"
        share = f"{headroom:.0%} of " if headroom < 1 else ""
        if self.reason == "ttft":
            return (
                f"SLO cannot be met under the current load: estimated TTFT {est.ttft_s * 1e3:.0f} ms > "
                f"{share}ttft_ms {(ttft_s or 0) * 1e3:g}"
            )
        return (
            f"SLO cannot be met under the current load: estimated TBT {est.tbt_s * 1e3:.0f} ms at a batch of "
            f"{est.batch} > {share}tbt_ms {(tbt_s or 0) * 1e3:g}"
        )


ADMITTED = Decision(True, "")
COLD_SEQS = 8  # requests a worker holds at most until it has run SpeedFit.min_samples steps


def decide_cold(view: QueueView, fit: SpeedFit) -> Decision | None:
    """Until a worker's speed is measured (its first steps), its prior may be off by 10x (an
    analytic roofline, an emulated device): it holds at most COLD_SEQS requests, whose first
    steps measure it. None once measured, or while it holds fewer."""
    if fit.num_samples >= fit.min_samples or len(view.running_left) + len(view.waiting_prompts) < COLD_SEQS:
        return None
    return Decision(False, "cold")


def decide(est: Estimate, ttft_s: float | None, tbt_s: float | None, headroom: float = 1.0) -> Decision:
    """Admit when the estimate meets every SLO given within `headroom` of it (a share, <= 1);
    otherwise name the first it does not."""
    if ttft_s is not None and est.ttft_s > headroom * ttft_s:
        return Decision(False, "ttft", est)
    if tbt_s is not None and est.tbt_s > headroom * tbt_s:
        return Decision(False, "tbt", est)
    return Decision(True, "", est)
