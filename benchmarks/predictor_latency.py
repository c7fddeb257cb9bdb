"""Length predictor: one-prompt latency as wall time and as CPU time, on held-out ShareGPT first turns.

    python benchmarks/predictor_latency.py [--model DIR] [--json docs/results/data/predictor_latency.json]

On a shared machine the wall time of one prompt measures the queue for the cores as much as
the predictor; the CPU time the process spends on it (onnxruntime with one intra-op thread
runs on the calling thread) is what one dedicated core would take. Both are recorded, the
load average beside them, for:
- the served path (`LengthPredictor.predict`: tokenize, encode, head, search, blend) with the
  model directory's encoder at fp32 and int8;
- the encoder alone with all six MiniLM layers and with the model's layers, fp32 and int8;
- two parts of the served int8 path: tokenizing, and everything after the embedding.
Every variant runs on the same prompts, interleaved prompt by prompt (the machine's speed
drifts, so side by side is the only fair comparison), two rounds.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from predictor_service import artefacts
from predictor_service.data import load_samples
from predictor_service.encoder import FULL_LAYERS, OnnxEncoder, PromptTokenizer
from predictor_service.evaluate import select
from predictor_service.export import export_encoder
from predictor_service.predictor import LengthPredictor
from sluice.common.paths import data_file
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

SHAREGPT = "prompts/sharegpt_v3_conversations.jsonl.gz"


def interleaved(calls: dict[str, Callable[[str], Any]], prompts: list[str], rounds: int) -> dict[str, Any]:
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for fn in calls.values():
        for text in prompts[:5]:
            fn(text)  # warm-up
    for _ in range(rounds):
        for text in prompts:
            for name, fn in calls.items():
                w0, c0 = time.perf_counter(), time.process_time()
                fn(text)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    return {
        name: {
            "wall_p50_ms": float(np.median(wall[name]) * 1e3),
            "wall_p99_ms": float(np.percentile(wall[name], 99) * 1e3),
            "cpu_p50_ms": float(np.median(cpu[name]) * 1e3),
            "cpu_p99_ms": float(np.percentile(cpu[name], 99) * 1e3),
            "n": len(wall[name]),
        }
        for name in calls
    }


def latency_table(latency: dict[str, dict[str, float]]) -> str:
    keys = {
        "wall p50 ms": "wall_p50_ms",
        "wall p99 ms": "wall_p99_ms",
        "cpu p50 ms": "cpu_p50_ms",
        "cpu p99 ms": "cpu_p99_ms",
    }
    rows = [{"path": name, **{col: r[key] for col, key in keys.items()}} for name, r in latency.items()]
    return format_table(rows, formats=dict.fromkeys(keys, "{:.2f}"))


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--model", default=str(artefacts.default_model_dir()))
    p.add_argument("--json", default="docs/results/data/predictor_latency.json")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    held_out = select(load_samples(data_file(SHAREGPT)), "test", True, None)[: args.prompts]
    prompts = [s.prompt for s in held_out]
    layers = artefacts.encoder_layers(artefacts.read_config(args.model))
    tokenizer = PromptTokenizer()
    result: dict[str, Any] = {
        "prompts": len(prompts),
        "input_tokens_p50": float(np.median(tokenizer.num_tokens(prompts))),
        "model_layers": layers,
        "load_average_before": os.getloadavg(),
    }
    predictors = {f"served/{p}": LengthPredictor(args.model, threads=1, precision=p) for p in ("fp32", "int8")}
    calls: dict[str, Callable[[str], Any]] = {
        name: (lambda text, pr=pr: pr.predict([text], "chatgpt-sharegpt")) for name, pr in predictors.items()
    }
    # Where the served path's time goes besides the encoder: tokenizing, and everything after
    # the embedding (head, history search, blend, bin vote), on the int8 predictor.
    served = predictors["served/int8"]
    embedded = {text: served.embed([text]) for text in prompts}
    calls["served/int8 part: tokenize"] = lambda text: served.encoder.tokenizer.batch([text])
    calls["served/int8 part: after encoder"] = lambda text: served.predict_embedded(
        embedded[text], [text], ["chatgpt-sharegpt"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted({FULL_LAYERS, layers}):
            for precision in ("fp32", "int8"):
                path = export_encoder(Path(tmp) / f"e{n}{precision}.onnx", 128, precision, n)
                enc = OnnxEncoder(path, tokenizer, 1, "cpu")
                calls[f"encoder {n} layers/{precision}"] = lambda text, e=enc: e.encode_ids(*e.tokenizer.batch([text]))
        result["latency"] = interleaved(calls, prompts, args.rounds)
    result["load_average_after"] = os.getloadavg()
    print(latency_table(result["latency"]))
    print("load average", result["load_average_before"], result["load_average_after"])
    write_json(result, args.json, indent=2, quiet=True)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
