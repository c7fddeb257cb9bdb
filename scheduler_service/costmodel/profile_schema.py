"""The worker profile file that `sluice profile` writes and the fitted cost model reads.

    {
      "schema": "sluice.profile/v1",
      "model": {ModelSpec fields},          # dimensions of the profiled model
      "device": "cpu" | "cuda:0 (NVIDIA H100 80GB HBM3)",
      "dtype": "float32" | "bfloat16" | "float16",
      "block_size": 16,
      "created": "2026-11-21T10:00:00Z",
      "steps": [ {"shape": BatchShape.to_dict(), "time_s": median, "times_s": [...]} ... ],
      "swaps": [ {"direction": "out"|"in", "num_blocks": n, "bytes": b, "int8": bool,
                  "time_s": median} ... ]
    }

Every step sample is a full BatchShape (prefill-only, decode-only and mixed batches), so
the fitted model regresses on exactly the features it prices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scheduler_service.costmodel.base import BatchShape, ModelSpec

SCHEMA = "sluice.profile/v1"


@dataclass(slots=True)
class StepSample:
    shape: BatchShape
    time_s: float
    times_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SwapSample:
    direction: str  # "out" (GPU -> CPU) or "in"
    num_blocks: int
    bytes: int
    time_s: float
    int8: bool = False


@dataclass(slots=True)
class WorkerProfile:
    model: ModelSpec
    device: str
    dtype: str
    block_size: int
    created: str
    steps: list[StepSample] = field(default_factory=list)
    swaps: list[SwapSample] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": asdict(self.model),
            "device": self.device,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "created": self.created,
            "steps": [{"shape": s.shape.to_dict(), "time_s": s.time_s, "times_s": s.times_s} for s in self.steps],
            "swaps": [asdict(s) for s in self.swaps],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: dict) -> WorkerProfile:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file (schema={d.get('schema')!r})")
        return cls(
            model=ModelSpec(**d["model"]),
            device=d["device"],
            dtype=d["dtype"],
            block_size=int(d["block_size"]),
            created=d.get("created", ""),
            steps=[
                StepSample(BatchShape.from_dict(s["shape"]), float(s["time_s"]), list(s.get("times_s", [])))
                for s in d["steps"]
            ],
            swaps=[SwapSample(**s) for s in d.get("swaps", [])],
        )

    @classmethod
    def load(cls, path: str | Path) -> WorkerProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))
