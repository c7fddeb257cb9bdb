"""The papers' metrics, with one definition for the simulator and the live service.

The core reports events (admitted, rejected, preempted, finished, step done); per-token
times live on the Request (`token_times`) and are folded in when it finishes, so nothing
is recorded per token on the hot path. `summary()` returns the keys of DESIGN.md:

- TTFT = first token - arrival; TBT = every gap between consecutive tokens; JCT = last
  token - arrival; normalized latency = mean over requests of JCT / output tokens.
- SLO attainment: iteration-level = share of token events (first token vs TTFT SLO, each
  gap vs TBT SLO) that met them; request-level = share of ended requests meeting all
  their SLOs, with TBT judged on the request's mean gap (DistServe's TPOT rule), and
  rejected / timed-out / failed requests counted as misses; JCT-level = share of requests
  with a JCT SLO that met it. Goodput = requests meeting all SLOs per second.
- compute utilization = mean over steps of forward size / the policy's token budget
  (AccelGen); KV utilization = mean over steps of allocated / total GPU blocks; used KV =
  mean over steps of the tokens whose KV exists (computed tokens of the requests holding GPU
  KV, at most what is allocated) / the GPU KV's tokens. The gap between the two is KV
  allocated ahead of use (whole prompts, reservations, padding; KVCPipe's target).
- load imbalance = std of per-worker busy time (SCLS).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from scheduler_service.core.preemption import PreemptionMode, PreemptionReason, RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.slo import judge_slo

if TYPE_CHECKING:
    from kvstore.accounting import KVCacheManager
    from sluice.contract.plan import StepPlan, StepResult

METRIC_KEYS = (
    "throughput_tok_s",
    "throughput_req_s",
    "goodput_req_s",
    "slo_attainment_iter",
    "slo_attainment_req",
    "slo_attainment_jct",
    "ttft_s",
    "tbt_s",
    "jct_s",
    "normalized_latency_s",
    "compute_util_mean",
    "kv_util_mean",
    "kv_used_mean",
    "preemptions",
    "kv_alloc_failures",
    "sched_overhead_ms",
    "load_imbalance_s",
    "num_finished",
    "num_requests",
)

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


def percentiles(values: array | list[float], scale: float = 1.0) -> dict[str, float | None]:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.frombuffer(values, dtype=np.float64) if isinstance(values, array) else np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()) * scale,
        "p50": float(p50) * scale,
        "p90": float(p90) * scale,
        "p99": float(p99) * scale,
    }


class MetricsRecorder:
    def __init__(self) -> None:
        self.num_requests = 0
        self.rejected: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()
        self.preemptions: Counter[tuple[str, str]] = Counter()
        self.kv_alloc_failures = 0
        self.ttft = array("d")
        self.jct = array("d")
        self.normalized_latency = array("d")
        self.queue_time = array("d")
        self.tbt = array("d")
        self.output_tokens = 0
        self.iter_events = 0
        self.iter_met = 0
        self.req_judged = 0
        self.req_met = 0
        self.jct_judged = 0
        self.jct_met = 0
        self.first_arrival = math.inf
        self.last_finish = -math.inf
        self.num_steps = 0
        self.compute_util_sum = 0.0
        self.kv_util_sum = 0.0
        self.kv_used_sum = 0.0
        self.forward_tokens = 0
        self.busy_s: dict[int, float] = {}
        self.sched_overhead_s = array("d")
        self.swap_bytes = 0
        self.pad_tokens = 0
        self.invalid_tokens = 0
        self.prefill_tokens = 0  # prompt (and recomputed) tokens computed by forward passes
        self.prefix_lookups = 0  # admissions of a KV-less request with prefix caching on
        self.prefix_query_tokens = 0  # their tokens
        self.prefix_hit_tokens = 0  # of which found cached (not computed again)

    # ------------------------------------------------------------------ events
    def on_admitted(self, request: Request) -> None:
        self.num_requests += 1
        self.first_arrival = min(self.first_arrival, request.arrival_time)

    def on_reject(self, request: Request, reason: RejectReason, now: float) -> None:
        self.num_requests += 1
        self.first_arrival = min(self.first_arrival, request.arrival_time)
        self.rejected[str(reason)] += 1
        self._judge_missed(request)

    def on_preempt(self, request: Request, mode: PreemptionMode, reason: PreemptionReason, now: float) -> None:
        # NOTE: a StrEnum member's `_value_` is its str() (dozens of pauses a step under the
        # queue policies; str() of a member costs a call each)
        self.preemptions[(mode._value_, reason._value_)] += 1

    def on_pauses(self, requests: list[Request], reason: PreemptionReason, now: float) -> None:
        """`on_preempt(req, KEEP, reason, now)` of each request, counted once for all of them
        (a subclass that follows each preemption gets its calls)."""
        if type(self).on_preempt is not MetricsRecorder.on_preempt:
            for req in requests:
                self.on_preempt(req, PreemptionMode.KEEP, reason, now)
        elif requests:
            self.preemptions[(PreemptionMode.KEEP._value_, reason._value_)] += len(requests)

    def on_prefix_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        self.prefix_lookups += 1
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += hit_tokens

    def on_schedule_overhead(self, seconds: float) -> None:
        self.sched_overhead_s.append(seconds)

    def on_finish(self, request: Request, now: float) -> None:
        self.ended[request.status.name] += 1
        self.last_finish = max(self.last_finish, now)
        if request.status is RequestStatus.FINISHED_REJECTED:
            # A policy's or the driver's late rejection: its message starts with the reason.
            self.rejected[request.finish_message.partition(":")[0] or "rejected"] += 1
        if request.status not in _COMPLETED:
            if request.status is not RequestStatus.FINISHED_ABORTED:
                self._judge_missed(request)
            return
        times = request.token_times
        arrival = request.arrival_time
        jct = times[-1] - arrival
        ttft = times[0] - arrival
        self.ttft.append(ttft)
        self.jct.append(jct)
        self.normalized_latency.append(jct / len(times))
        self.queue_time.append(request.queue_time)
        self.output_tokens += len(times)
        gaps = np.diff(np.frombuffer(times, dtype=np.float64)) if len(times) > 1 else np.empty(0)
        self.tbt.extend(gaps.tolist())
        self._judge(request, ttft, jct, gaps)

    def _judge(self, request: Request, ttft: float, jct: float, gaps: np.ndarray) -> None:
        slo = request.slo
        # iteration level: every token event against its own objective
        if slo.ttft_s is not None:
            self.iter_events += 1
            self.iter_met += ttft <= slo.ttft_s
        if slo.tbt_s is not None and len(gaps):
            self.iter_events += len(gaps)
            self.iter_met += int(np.count_nonzero(gaps <= slo.tbt_s))
        # request level: the one rule (core/slo.py) the live service's final timings use too
        verdict = judge_slo(slo, request.arrival_time, request.token_times)
        if verdict.jct_met is not None:
            self.jct_judged += 1
            self.jct_met += verdict.jct_met
        self.req_judged += 1
        self.req_met += verdict.met

    def _judge_missed(self, request: Request) -> None:
        self.req_judged += 1
        if request.slo.jct_s is not None:
            self.jct_judged += 1

    def on_step(
        self,
        worker_id: int,
        plan: StepPlan,
        result: StepResult,
        now: float,
        kv: KVCacheManager,
        used_tokens: int = 0,
    ) -> None:
        """`used_tokens`: tokens whose KV exists on the GPU after the step."""
        n = sum(plan.num_scheduled_tokens.values())
        self.num_steps += 1
        self.forward_tokens += n
        if plan.token_budget:
            self.compute_util_sum += n / plan.token_budget
        gpu = kv.gpu
        if blocks := gpu.num_blocks:
            used_blocks = gpu.num_used
            self.kv_util_sum += used_blocks / blocks
            # NOTE: shared prefix blocks count once per sharer; capping at the allocated
            # tokens keeps "used" within "allocated".
            self.kv_used_sum += min(used_tokens, used_blocks * kv.block_size) / (blocks * kv.block_size)
        self.busy_s[worker_id] = self.busy_s.get(worker_id, 0.0) + result.total_s
        self.swap_bytes += result.swap_bytes
        if plan.metadata:
            self.pad_tokens += int(plan.metadata.get("pad_tokens", 0))
            self.invalid_tokens += int(plan.metadata.get("invalid_tokens", 0))

    # ------------------------------------------------------------------ summary
    @property
    def num_finished(self) -> int:
        return len(self.jct)

    def window_s(self) -> float:
        if not math.isfinite(self.first_arrival) or not math.isfinite(self.last_finish):
            return 0.0
        return max(self.last_finish - self.first_arrival, 1e-9)

    def summary(self) -> dict:
        window = self.window_s()
        rate = (lambda x: x / window) if window > 0 else (lambda x: 0.0)
        ratio = lambda met, n: (met / n) if n else None  # noqa: E731
        busy = list(self.busy_s.values())
        return {
            "throughput_tok_s": rate(self.output_tokens),
            "throughput_req_s": rate(self.num_finished),
            "goodput_req_s": rate(self.req_met),
            "slo_attainment_iter": ratio(self.iter_met, self.iter_events),
            "slo_attainment_req": ratio(self.req_met, self.req_judged),
            "slo_attainment_jct": ratio(self.jct_met, self.jct_judged),
            "ttft_s": percentiles(self.ttft),
            "tbt_s": percentiles(self.tbt),
            "jct_s": percentiles(self.jct),
            "normalized_latency_s": percentiles(self.normalized_latency)["mean"],
            "compute_util_mean": self.compute_util_sum / self.num_steps if self.num_steps else None,
            "kv_util_mean": self.kv_util_sum / self.num_steps if self.num_steps else None,
            "kv_used_mean": self.kv_used_sum / self.num_steps if self.num_steps else None,
            "preemptions": sum(self.preemptions.values()),
            "kv_alloc_failures": self.kv_alloc_failures,
            "sched_overhead_ms": {
                k: v for k, v in percentiles(self.sched_overhead_s, scale=1e3).items() if k in ("mean", "p99")
            },
            "load_imbalance_s": float(np.std(busy)) if len(busy) > 1 else 0.0,
            "num_finished": self.num_finished,
            "num_requests": self.num_requests,
        }

    def details(self) -> dict:
        """What the papers report beyond DESIGN's keys (kept out of `metrics`)."""
        return {
            "rejected_by_reason": dict(self.rejected),
            "ended_by_status": dict(self.ended),
            "preemptions_by_mode_reason": {f"{m}/{r}": n for (m, r), n in sorted(self.preemptions.items())},
            "queue_time_s": percentiles(self.queue_time),
            "output_tokens": self.output_tokens,
            "num_steps": self.num_steps,
            "mean_forward_size": self.forward_tokens / self.num_steps if self.num_steps else None,
            "busy_s_per_worker": {str(k): v for k, v in sorted(self.busy_s.items())},
            "swap_bytes": self.swap_bytes,
            "pad_tokens": self.pad_tokens,
            "invalid_tokens": self.invalid_tokens,
            "prefill_tokens": self.prefill_tokens,
            "prefix_cache": {
                "lookups": self.prefix_lookups,
                "query_tokens": self.prefix_query_tokens,
                "hit_tokens": self.prefix_hit_tokens,
                "hit_rate": self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None,
            },
            "window_s": self.window_s(),
        }
