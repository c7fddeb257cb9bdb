"""Plan codec cost: one 256-decode step and its result, in the full and the steady-state form.

    full:     scheduled ids listed in the plan, sampled ids listed in the result
    repeated: `same_scheduled_ids` (the previous step's ids) and tokens in step order, as
              PlanSender / PlanReceiver send a steady decode step

Encode = `plan_to_proto(...).SerializeToString()`, decode = `plan_from_proto(FromString(bytes))`
(the same for results); best of 5 repeats of 500 calls each.

    python benchmarks/plan_codec.py [--num-seqs 256]
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

from sluice.contract.plan import CachedRequestData, StepPlan, StepResult
from sluice.contract.plan_codec import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto, step_order
from sluice.v1 import worker_pb2
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table

BLOCK_SIZE = 16


def decode_step(num_seqs: int) -> tuple[StepPlan, StepResult]:
    """Every request decodes; one in BLOCK_SIZE gets a new block this step."""
    ids = tuple(f"req-{i:05d}" for i in range(num_seqs))
    grown = [i for i in range(num_seqs) if i % BLOCK_SIZE == 0]
    cached = CachedRequestData(
        tuple(ids[i] for i in grown),
        tuple((i,) for i in grown),
        (False,) * len(grown),
        tuple(500 + i for i in grown),
    )
    plan = StepPlan(7, 0, (), cached, dict.fromkeys(ids, 1), frozenset(ids), token_budget=512)
    return plan, StepResult(7, {rid: 100 + i for i, rid in enumerate(ids)}, 0.01)


def per_call_ms(fn: Callable[[], object]) -> float:
    return min(timeit.repeat(fn, number=500, repeat=5)) / 500 * 1e3


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--num-seqs", type=int, default=256)
    args = p.parse_args()
    plan, result = decode_step(args.num_seqs)
    ids, order = list(plan.num_scheduled_tokens), step_order(plan)
    form = f"form ({args.num_seqs} decodes)"
    rows = []
    for label, same in (("full (ids listed both ways)", False), ("repeated ids, step-ordered tokens", True)):
        sent = plan_to_proto(plan, same_scheduled_ids=same).SerializeToString()
        answer_order = order if same else None
        answer = result_to_proto(result, answer_order).SerializeToString()
        assert plan_from_proto(worker_pb2.ExecuteRequest.FromString(sent), 0, ids) == plan
        assert result_from_proto(worker_pb2.ExecuteResponse.FromString(answer), plan) == result
        cells = (
            per_call_ms(lambda s=same: plan_to_proto(plan, same_scheduled_ids=s).SerializeToString()),
            per_call_ms(lambda b=sent: plan_from_proto(worker_pb2.ExecuteRequest.FromString(b), 0, ids)),
            per_call_ms(lambda o=answer_order: result_to_proto(result, o).SerializeToString()),
            per_call_ms(lambda b=answer: result_from_proto(worker_pb2.ExecuteResponse.FromString(b), plan)),
        )
        rows.append(
            {
                form: label,
                "plan bytes": len(sent),
                "plan encode ms": cells[0],
                "plan decode ms": cells[1],
                "result bytes": len(answer),
                "result encode ms": cells[2],
                "result decode ms": cells[3],
            }
        )
    ms = "{:.3f}"
    formats = {"plan bytes": "{:,}", "result bytes": "{:,}", **{k: ms for k in rows[0] if k.endswith(" ms")}}
    print_table(rows, formats=formats)


if __name__ == "__main__":
    main()
