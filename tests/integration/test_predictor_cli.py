"""`sluice predictor eval` and `export` on a small real slice; whole-trace predictions cached on disk."""

from __future__ import annotations

import json
from pathlib import Path

from predictor_service import artefacts
from predictor_service.trace import predict_prompts
from services.cli import main as sluice
from sluice.common.paths import data_file, open_text


def sluice_jsonl_slice(out: Path, n: int = 30) -> Path:
    """A Sluice JSONL file with prompts and responses from the first ShareGPT conversations."""
    lines = []
    with open_text(data_file("prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz")) as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt" and turns[1]["value"]:
                lines.append(
                    {"prompt": turns[0]["value"], "response": turns[1]["value"], "prompt_tokens": 1, "output_tokens": 1}
                )
            if len(lines) == n:
                break
    out.write_text("\n".join(json.dumps(r) for r in lines))
    return out


def test_eval_prints_and_writes_accuracy_and_latency(
    tiny_predictor_dir: Path, tmp_path: Path, capsys
) -> None:
    prompts = sluice_jsonl_slice(tmp_path / "slice.jsonl")
    out = tmp_path / "eval.json"
    argv = ["predictor", "eval", "--model", str(tiny_predictor_dir), "--prompts", str(prompts), "--json", str(out)]
    assert sluice([*argv, "--split", "all", "--latency-samples", "5", "--no-progress"]) == 0
    report = json.loads(out.read_text())
    for key in ("bucket_accuracy", "mae_tokens", "spearman", "p50_ms", "p99_ms", "cached_p50_ms"):
        assert key in capsys.readouterr().out or key in report
        assert isinstance(report[key], float)
    assert report["n"] == 30 and 0.0 <= report["bucket_accuracy"] <= 1.0
    assert report["cached_p50_ms"] < report["p50_ms"], "a cache hit skips the encoder"
    assert report["provider"] == "CPUExecutionProvider"
    assert (tmp_path / "eval.error_model.json").is_file()


def test_export_writes_a_self_contained_directory(tiny_predictor_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    assert sluice(["predictor", "export", "--model", str(tiny_predictor_dir), "--out", str(out)]) == 0
    assert (out / artefacts.ENCODER_FILE).is_file() and (out / artefacts.HEAD_FILE).is_file()
    assert artefacts.encoder_path(out) == out / artefacts.ENCODER_FILE


def test_predict_prompts_computes_a_trace_once_then_reads_the_cache(tiny_predictor_dir: Path, tmp_path: Path) -> None:
    texts = ["Write a limerick about Redis.", "Summarize the plot of Hamlet in detail.", "Hi"]
    cache = tmp_path / "trace.json"
    first = predict_prompts(tiny_predictor_dir, texts, "tiny-llama", cache, progress=False)
    assert len(first) == 3 and all(p.p10 <= p.tokens <= p.p90 for p in first)
    stored = json.loads(cache.read_text())
    assert "Hamlet" not in cache.read_text() and len(stored["prompts"]) == 3
    stored["predictions"][0]["tokens"] = 4242  # a marker: the second call must read the file
    cache.write_text(json.dumps(stored))
    assert predict_prompts(tiny_predictor_dir, texts, "tiny-llama", cache, progress=False)[0].tokens == 4242
    other = predict_prompts(tiny_predictor_dir, texts, "chatgpt-sharegpt", cache, progress=False)
    assert other[0].tokens != 4242, "another served model recomputes"
