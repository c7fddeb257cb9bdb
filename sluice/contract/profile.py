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

SCHEMA = "sluice.profile/v1"


@dataclass(slots=True)
class BatchShape:
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (new tokens, cached prefix)
    num_decodes: int = 0
    decode_context_sum: int = 0  # sum of context lengths (KV tokens read) over decodes
    decode_context_max: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for c, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        """Forward size: every prefill token plus one per decode."""
        return self.num_prefill_tokens + self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_chunks) + self.num_decodes

    def add_decode(self, context_len: int) -> None:
        self.num_decodes += 1
        self.decode_context_sum += context_len
        if context_len > self.decode_context_max:
            self.decode_context_max = context_len

    def to_dict(self) -> dict:
        return {
            "prefill_chunks": [list(c) for c in self.prefill_chunks],
            "num_decodes": self.num_decodes,
            "decode_context_sum": self.decode_context_sum,
            "decode_context_max": self.decode_context_max,
            "swap_out_bytes": self.swap_out_bytes,
            "swap_in_bytes": self.swap_in_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> BatchShape:
        return cls(
            prefill_chunks=[(int(a), int(b)) for a, b in d.get("prefill_chunks", [])],
            num_decodes=int(d.get("num_decodes", 0)),
            decode_context_sum=int(d.get("decode_context_sum", 0)),
            decode_context_max=int(d.get("decode_context_max", 0)),
            swap_out_bytes=int(d.get("swap_out_bytes", 0)),
            swap_in_bytes=int(d.get("swap_in_bytes", 0)),
        )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer dimensions (whole model; tensor parallelism divides per GPU)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = True  # SwiGLU (llama family) vs plain 2-matrix MLP (OPT)
    tensor_parallel: int = 1
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2
        mlp = h * self.intermediate_size * (3 if self.gated_mlp else 2)
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * h

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.num_params * self.dtype_bytes // self.tensor_parallel

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, whole model."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        # NOTE: with fewer KV heads than GPUs each GPU keeps a full copy of one head.
        heads = max(1, self.num_kv_heads // self.tensor_parallel)
        return 2 * self.num_layers * heads * self.head_dim * self.dtype_bytes


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
