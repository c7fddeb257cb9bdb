"""Named swap pricings for the simulator: what a swap costs beyond bytes / PCIe bandwidth.

The simulator prices a swap as `bytes / hardware.pcie_bandwidth + blocks x 2 x layers x
copy_overhead_s + stall_s` (one stall per step that swaps). `--swap-costs NAME` sets both
terms from one of these; `--swap-copy-overhead-s` / `--swap-stall-s` set them by hand.

- `vllm-v0`: vLLM v0's copy loop, an assumption (not measured here): one cudaMemcpyAsync per
  layer for keys and one for values of each block, about 5 us of launch and DMA set-up each,
  and the step waits about 1 ms for the copies before its forward pass.
- `sluice-h100`: Sluice's own worker, measured on one H100 80GB HBM3 (PCIe 5) with Llama-3-8B
  blocks of 16 tokens (2 MiB): `python benchmarks/gpu_suite.py --phases roofline,swap` (16-512
  blocks swapped out and in, a line fitted through the times, docs/results/gpu_worker.md). Its
  gather-then-copy swap pays 0.13-0.28 ms per swap section and moves 45.8 GB/s out, 48.5 GB/s
  in; against the H100 preset's 50 GB/s that is 3.9 us more per block out and none in, i.e.
  0.06 us per per-layer copy in the terms above. A swap the cost model prices from a measured
  profile (`--cost-model fitted`) already includes these: use `none` there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SwapCosts:
    copy_overhead_s: float  # per KV copy call (2 x layers calls per block)
    stall_s: float  # per step that swaps
    measured: bool


SWAP_COSTS: dict[str, SwapCosts] = {
    "none": SwapCosts(0.0, 0.0, measured=False),
    "vllm-v0": SwapCosts(5e-6, 1e-3, measured=False),
    "sluice-h100": SwapCosts(6e-8, 2.1e-4, measured=True),
}


def swap_costs(name: str) -> SwapCosts:
    try:
        return SWAP_COSTS[name]
    except KeyError:
        raise ValueError(f"--swap-costs must be one of {', '.join(SWAP_COSTS)}, got {name!r}") from None
