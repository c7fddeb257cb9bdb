"""Plan identity: every policy makes exactly the decisions recorded in tests/data/plan_digests.json
on several traces and seeds, step by step (scheduled tokens in batch order, samples, swaps,
releases, preemptions, returns and ends). Speed work on policies and on the core must keep
this green; a change meant to alter decisions records the goldens again
(`python tests/sim/plan_digest.py`) and says why in its commit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_digest import CHECKPOINT_EVERY, all_keys, case_key, load_goldens, run_case

GOLDENS = load_goldens()


def test_goldens_cover_every_case_and_policy() -> None:
    from scheduler_service import policies  # noqa: F401
    from scheduler_service.core.policy import POLICIES

    keys = {case_key(*k) for k in all_keys()}
    assert keys == set(GOLDENS), "record the goldens again: python tests/sim/plan_digest.py"
    covered = {k.split("|")[0].split(":")[0] for k in keys}
    assert set(POLICIES.names()) <= covered


@pytest.mark.parametrize(("policy", "trace", "seed", "overlap"), all_keys(), ids=lambda v: str(v))
def test_plans_match_the_goldens(policy: str, trace: str, seed: int, overlap: bool) -> None:
    want = GOLDENS[case_key(policy, trace, seed, overlap)]
    got = run_case(policy, trace, seed, overlap)
    if got != want:
        diverged = next(
            (i for i, (a, b) in enumerate(zip(got["checkpoints"], want["checkpoints"], strict=False)) if a != b),
            min(len(got["checkpoints"]), len(want["checkpoints"])),
        )
        pytest.fail(
            f"decisions changed from step ~{diverged * CHECKPOINT_EVERY} on: "
            f"got { ({k: v for k, v in got.items() if k != 'checkpoints'}) }, "
            f"want { ({k: v for k, v in want.items() if k != 'checkpoints'}) }"
        )


def test_a_changed_decision_changes_the_digest() -> None:
    """The digest sees a single different decision (so the goldens can fail)."""
    base = run_case("vllm", "mooncake", 0, False)
    assert base == GOLDENS[case_key("vllm", "mooncake", 0, False)]
    other = run_case("vllm_chunked", "mooncake", 0, False)  # same workload, chunked prefill
    assert other["digest"] != base["digest"]
