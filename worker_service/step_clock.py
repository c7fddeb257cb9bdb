"""Timings inside one engine step without making the host wait for the device.

    clock = StepClock(device); ...; clock.mark("prepared"); ...; clock.mark("forward"); ...
    clock.wait()                      # the one wait (after the step's own synchronisation)
    clock.seconds("prepared", "forward")   device time between two marks
    clock.host_seconds("prepared")         host time from the clock's creation to a mark

On CUDA a mark records an event on the current stream, so `seconds` is the GPU time between
two points of the queue; on a CPU every operation has finished when it returns, so a mark is
the host clock.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.host: dict[str, float] = {}
        self.events: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        self.host[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event

    def wait(self) -> None:
        if self.events:
            next(reversed(self.events.values())).synchronize()

    def seconds(self, first: str, last: str) -> float:
        if self.cuda:
            return self.events[first].elapsed_time(self.events[last]) / 1e3
        return self.host[last] - self.host[first]

    def host_seconds(self, name: str) -> float:
        return self.host[name] - self.start
