"""What the engine's device can do, as the scheduler's cost model needs it (worker Info).

    describe_hardware(device, dtype) -> HardwareInfo
        CUDA: the driver's device name -> a preset name the scheduler knows (H100 -> h100-80g ...)
              + measured figures (a bf16/fp16 matrix product, a device-to-device copy, a pinned
              host-to-device copy)
        CPU:  measured figures (a float32 matrix product, a large copy), no preset

Measured once per process and device (about 0.1 s on a CPU), so many in-process workers (the
tests) pay it once. The figures are what this device reaches, not data-sheet peaks: a
scheduler pricing a CPU or an unlisted GPU with them gets a roofline of what really runs.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

# Substrings of CUDA device names -> the scheduler's hardware presets (costmodel/presets.py).
_GPU_PRESETS = (("H200", "h200"), ("H100", "h100-80g"), ("A100", "a100-80g"), ("A40", "a40"), ("V100", "v100-32g"))


@dataclass(frozen=True, slots=True)
class HardwareInfo:
    preset: str  # "" when none applies
    name: str
    peak_flops: float
    memory_bandwidth: float  # bytes/s, read + written
    memory_bytes: float
    host_link_bandwidth: float  # bytes/s host <-> device


def describe_hardware(device: torch.device, dtype: torch.dtype) -> HardwareInfo:
    return _describe(str(device), dtype)


@functools.cache
def _describe(device: str, dtype: torch.dtype) -> HardwareInfo:
    dev = torch.device(device)
    if dev.type == "cuda":
        return _describe_cuda(dev, dtype)
    threads = torch.get_num_threads()
    flops = _matmul_flops(dev, torch.float32 if dtype not in (torch.float32, torch.float64) else dtype, 512, 8)
    bandwidth = _copy_bandwidth(dev, 32 * 2**20, 4)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return HardwareInfo("", f"cpu ({threads} threads)", flops, bandwidth, memory, bandwidth)


def _describe_cuda(dev: torch.device, dtype: torch.dtype) -> HardwareInfo:
    props = torch.cuda.get_device_properties(dev)
    preset = next((p for key, p in _GPU_PRESETS if key in props.name), "")
    if preset == "a100-80g" and props.total_memory < 60 * 2**30:
        preset = ""  # an A100 40GB differs from the preset in memory and bandwidth
    flops = _matmul_flops(dev, dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16, 8192, 5)
    bandwidth = _copy_bandwidth(dev, 2**30, 5)
    host = _host_to_device_bandwidth(dev, 256 * 2**20, 5)
    return HardwareInfo(preset, props.name, flops, bandwidth, float(props.total_memory), host)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_seconds(dev: torch.device, fn: object, repeats: int) -> float:
    fn()  # type: ignore[operator]  # warm-up: allocation, kernel selection
    _sync(dev)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(dev)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _matmul_flops(dev: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    # NOTE: random data, not zeros: zeros run faster on some GPUs and would overstate the peak.
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    seconds = _median_seconds(dev, lambda: torch.mm(a, b), repeats)
    return 2.0 * n**3 / seconds


def _copy_bandwidth(dev: torch.device, num_bytes: int, repeats: int) -> float:
    src = torch.randn(num_bytes // 4, device=dev)
    dst = torch.empty_like(src)
    seconds = _median_seconds(dev, lambda: dst.copy_(src), repeats)
    return 2.0 * num_bytes / seconds  # bytes read plus bytes written


def _host_to_device_bandwidth(dev: torch.device, num_bytes: int, repeats: int) -> float:
    host = torch.randn(num_bytes // 4).pin_memory()
    dst = torch.empty(num_bytes // 4, device=dev)
    seconds = _median_seconds(dev, lambda: dst.copy_(host, non_blocking=True), repeats)
    return num_bytes / seconds
