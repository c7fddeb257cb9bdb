"""The pure decision rules of Sluice's policies, on plain numbers: Sluice's own policies and
the vLLM plug-in (`sluice_vllm`) call these same functions, so a rule changes in one place.

Why numbers and not `Request`: the plug-in sees vLLM's request objects, not ours; each caller
reads its own request type and passes the fields a rule needs.

    waiting order   priority_key (strict priority), alise_rank (predicted remaining time,
                    aged), mlfq_rank (FastServe), accelgen deadline (online_remaining_s,
                    jct_allowed_s)
    token budget    budget_from_tbt_slo (Sarathi, SLO-derived), eq6_budget (AccelGen Eq. 6)
    victims         priority_victim_key (largest first), and the worst-ranked holder for the
                    queue policies (the end of their rank order)
"""

from __future__ import annotations

import math
from typing import Protocol

# ---------------------------------------------------------------------------- priorities


def priority_key(priority: int, arrival_time: float) -> tuple[int, float]:
    """Waiting order under strict priority: smaller value first, then arrival."""
    return (priority, arrival_time)


def priority_victim_key(priority: int, arrival_time: float) -> tuple[int, float]:
    """Running requests sorted by this, descending, put the next victim LAST: the lowest
    priority (largest value), and among those the earliest arrival."""
    return (-priority, arrival_time)


def slo_class_rank(offline: bool) -> int:
    """Online requests (judged by TTFT/TBT) before offline ones (judged by JCT)."""
    return 1 if offline else 0


def is_offline_slo(ttft_s: float | None, tbt_s: float | None, jct_s: float | None) -> bool:
    """AccelGen's offline request: a JCT SLO and no per-token SLO."""
    return jct_s is not None and ttft_s is None and tbt_s is None


# ---------------------------------------------------------------------------- Sarathi


class PrefillPricer(Protocol):
    def prefill_time(self, num_tokens: int) -> float: ...


def budget_from_tbt_slo(cost_model: PrefillPricer, tbt_slo_s: float, tile: int, max_tokens: int = 16384) -> int:
    """Sarathi's tau: the largest multiple of `tile` whose prefill iteration time fits in the
    TBT SLO (at least one tile, so progress is always possible)."""
    best = tile
    size = tile
    while size <= max_tokens and cost_model.prefill_time(size) <= tbt_slo_s:
        best = size
        size += tile
    return best


# ---------------------------------------------------------------------------- AccelGen


def eq6_budget(pivot_tokens: int, pivot_s: float, slo_min_s: float, min_budget: int, cap: int) -> int:
    """AccelGen's Eq. 6, `S_b = S_pf * SLO_min / T_pf`, floored at `min_budget` and capped."""
    s_b = int(pivot_tokens * slo_min_s / pivot_s)
    return max(min(min_budget, cap), min(s_b, cap))


def iteration_slo_s(
    num_output_tokens: int, ttft_s: float | None, tbt_s: float | None, default_ttft_s: float, default_tbt_s: float
) -> float:
    """TTFT SLO for the prompt, TBT SLO for each later token (defaults when absent)."""
    if num_output_tokens == 0:
        return ttft_s if ttft_s is not None else default_ttft_s
    return tbt_s if tbt_s is not None else default_tbt_s


def num_chunks(prefill_remaining: int, avg_chunk: float) -> int:
    """N_ck = ceil(S_r / L_c) for a prompt (or its rest), 1 for a decode."""
    return max(1, math.ceil(prefill_remaining / avg_chunk)) if prefill_remaining else 1


def online_remaining_s(iteration_slo: float, n_chunks: int, t_max_s: float) -> float:
    """T_r at queue entry (T_w = 0): SLO - N_ck * T_max; the deadline is entry + T_r."""
    return iteration_slo - n_chunks * t_max_s


def jct_allowed_s(
    slo_left_s: float, n_chunks: int, tokens_left: int, t_max_s: float, p_max_s: float, p: float
) -> float:
    """An offline request's allowed wait per iteration: (SLO_JCT - T_e) / (N_ck + S_g), with
    `T_e = N_ck * T_max + S_g * (T_max + P_max * P)`."""
    t_e = n_chunks * t_max_s + tokens_left * (t_max_s + p_max_s * p)
    return (slo_left_s - t_e) / (n_chunks + tokens_left)


# ---------------------------------------------------------------------------- ALISE


def alise_remaining_s(
    t0: float, alpha: float, beta: float, prefill_left: int, context_tokens: int, predicted: int, generated: int
) -> float:
    """ALISE's Eq. 4-5 remaining time: `T_pre(prefill left) + T_dec(context, predicted - generated)`
    (at least one token left)."""
    left = predicted - generated
    pre = t0 * prefill_left if prefill_left > 0 else 0.0
    return (left if left > 1 else 1) * (alpha * context_tokens + beta) + pre


def alise_level(remaining_s: float, level_base_s: float, num_queues: int) -> int:
    """Queue of a job by remaining time: 1 below the base, one more per doubling."""
    if remaining_s < level_base_s:
        return 1
    return min(num_queues, 2 + int(math.log2(remaining_s / level_base_s)))


def aging_due(clock: float, age_s: float, now: float) -> bool:
    """A job not served since `clock` moves up one queue once `age_s` has passed."""
    return clock + age_s <= now


def mispredicted_length(predicted: int, generated: int) -> int:
    """A job that reached its prediction without finishing: the prediction doubles."""
    return max(2 * predicted, generated + 1)


def demoted_level(level: int, remaining_s: float, level_base_s: float, num_queues: int) -> int:
    """After a misprediction: at least one queue down, and no better than its new remaining time."""
    return min(num_queues, max(level + 1, alise_level(remaining_s, level_base_s, num_queues)))


# ---------------------------------------------------------------------------- FastServe


def mlfq_quanta(base_s: float, num_queues: int) -> list[float]:
    """Quanta doubling per level."""
    return [base_s * 2**i for i in range(num_queues)]


def skip_join_level(quanta: list[float], prefill_s: float) -> int:
    """Skip-join: the first queue whose quantum covers the job's prefill time."""
    return next((i for i, q in enumerate(quanta) if q >= prefill_s), len(quanta) - 1)


def quantum_spent(level: int, attained_s: float, quanta: list[float]) -> bool:
    """The job used its level's quantum and is not on the last level: it is demoted."""
    return attained_s >= quanta[level] and level < len(quanta) - 1
