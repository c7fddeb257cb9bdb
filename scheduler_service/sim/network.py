"""Network links for the simulator's KV transfers (disaggregated prefill and decode), fitted
to Vidur's measured point-to-point (NCCL send/recv) times in `profiles/vidur/network/`:

    nvlink       two GPUs of one DGX node (NVLink/NVSwitch)      <gpu>_dgx, devices_per_node 2
    infiniband   two DGX nodes (the DGX's InfiniBand NICs)        <gpu>_dgx, devices_per_node 1
    pcie         two GPUs of one node without NVLink between them a100_pairwise_nvlink, devices_per_node 1
    ethernet     nominal 25 Gb/s line rate and 50 us latency: the data has no Ethernet table

A transfer of n bytes takes latency + n / bandwidth: the bandwidth is the slope of a
least-squares line through the messages of at least 1 MiB (KV of a block or more), the
latency the median time of the smallest message (2 KiB).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from functools import lru_cache

from sluice.common.paths import data_file, open_text

NETWORKS = ("nvlink", "infiniband", "pcie", "ethernet")
_MEASURED = {
    "nvlink": ("{gpu}_dgx", "2"),
    "infiniband": ("{gpu}_dgx", "1"),
    "pcie": ("a100_pairwise_nvlink", "1"),
}
ETHERNET_BANDWIDTH_BPS = 25e9 / 8
ETHERNET_LATENCY_S = 50e-6
_FIT_MIN_BYTES = 2**20


@dataclass(frozen=True, slots=True)
class NetworkLink:
    name: str
    bandwidth_bps: float  # bytes per second
    latency_s: float
    source: str  # where the numbers come from

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps if nbytes > 0 else 0.0


def gpu_family(hardware_name: str) -> str:
    """The profiled node type closest to a hardware preset (H200 uses the H100 DGX's links)."""
    return "h100" if hardware_name.startswith(("h100", "h200")) else "a100"


@lru_cache(maxsize=16)
def load_network(name: str, gpu: str = "a100") -> NetworkLink:
    if name == "ethernet":
        return NetworkLink(name, ETHERNET_BANDWIDTH_BPS, ETHERNET_LATENCY_S, "nominal 25 Gb/s (not measured)")
    if name not in _MEASURED:
        raise ValueError(f"unknown network {name!r}; known: {', '.join(NETWORKS)}")
    node, per_node = _MEASURED[name]
    node = node.format(gpu=gpu if gpu in ("a100", "h100") else "a100")
    rel = f"profiles/vidur/network/{node}/send_recv.csv"
    points: list[tuple[int, float]] = []
    with open_text(data_file(rel)) as f:
        for row in csv.DictReader(f):
            if row["devices_per_node"] == per_node:
                points.append((int(row["size"]), float(row["time_stats.send_recv.median"]) / 1e3))
    if not points:
        raise ValueError(f"{rel} has no rows with devices_per_node={per_node}")
    points.sort()
    big = [(s, t) for s, t in points if s >= _FIT_MIN_BYTES]
    mean_s = statistics.fmean(s for s, _ in big)
    mean_t = statistics.fmean(t for _, t in big)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in big) / sum((s - mean_s) ** 2 for s, _ in big)
    smallest = points[0][0]
    latency = statistics.median(t for s, t in points if s == smallest)
    return NetworkLink(name, 1.0 / slope, latency, f"{rel} (devices_per_node={per_node})")
