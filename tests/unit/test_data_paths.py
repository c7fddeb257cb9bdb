"""Data files are found one at a time in $SLUICE_DATA_DIR, the bundled data/, then the shared
folder beside the checkout; the bundle is what data/CONTENT_SHA256 and the bundle script say."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

from scheduler_service.workloads import load_trace
from sluice.common.paths import (
    DataFileNotFoundError,
    bundle_dir,
    data_file,
    data_roots,
    find_data_file,
    open_text,
    portable_path,
    repo_root,
)

AZURE_CONV = "traces/AzureLLMInferenceTrace_conv.csv"


def _bundle_tool():
    spec = importlib.util.spec_from_file_location("make_data_bundle", repo_root() / "tools" / "make_data_bundle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


TOOL = _bundle_tool()


def test_folders_are_searched_env_then_bundle_then_beside(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLUICE_DATA_DIR", raising=False)
    beside = repo_root().parent / "shared" / "data"
    assert data_roots() == [bundle_dir(), beside]
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    assert data_roots() == [tmp_path, bundle_dir(), beside]


def test_the_env_folder_wins_over_the_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLUICE_DATA_DIR", raising=False)
    assert data_file(AZURE_CONV) == bundle_dir() / (AZURE_CONV + ".gz")
    (tmp_path / "traces").mkdir()
    (tmp_path / AZURE_CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,3\n")
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    assert data_file(AZURE_CONV) == tmp_path / AZURE_CONV
    only = load_trace("azure-conv")
    assert [(r.prompt_tokens, r.output_tokens) for r in only] == [(5, 3)]


def test_a_gzipped_copy_stands_for_the_plain_name_and_reads_as_text(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with gzip.open(tmp_path / "a" / "x.csv.gz", "wt") as f:
        f.write("h\n1\n")
    found = find_data_file("a/x.csv", [tmp_path])
    assert found == tmp_path / "a" / "x.csv.gz"
    with open_text(found) as f:
        assert f.read() == "h\n1\n"
    assert find_data_file("a/y.csv", [tmp_path]) is None


def test_a_file_no_folder_has_is_one_line_naming_it_and_where_to_put_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_DATA_DIR", raising=False)
    with pytest.raises(DataFileNotFoundError) as info:
        data_file("prompts/not_bundled.jsonl.gz")
    message = str(info.value)
    assert "\n" not in message
    assert "'prompts/not_bundled.jsonl.gz'" in message and "SLUICE_DATA_DIR" in message
    assert "<folder>/prompts/not_bundled.jsonl.gz" in message


def test_a_short_name_whose_file_is_missing_says_which_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("scheduler_service.workloads.loader.SHORT_NAMES", {"gone": "traces/gone.csv"})
    with pytest.raises(FileNotFoundError, match=r"^trace 'gone': data file 'traces/gone.csv' is in none of"):
        load_trace("gone")


def test_every_bundled_file_matches_its_recorded_content_hash() -> None:
    sums = TOOL.read_sums(bundle_dir())
    on_disk = {
        p.relative_to(bundle_dir()).as_posix()
        for p in bundle_dir().rglob("*")
        if p.is_file() and p.name not in ("README.md", TOOL.SUMS_NAME)
    }
    assert set(sums) == on_disk == {e.bundled for e in TOOL.BUNDLE}
    for path, digest in sums.items():
        assert TOOL.sha256(TOOL.content_bytes(bundle_dir() / path)) == digest, path


def test_whole_files_are_byte_identical_to_upstream() -> None:
    whole = [e for e in TOOL.BUNDLE if e.upstream_sha256]
    assert len(whole) == 7  # five traces, two CodeAlpaca files
    for entry in whole:
        assert TOOL.sha256(TOOL.content_bytes(bundle_dir() / entry.bundled)) == entry.upstream_sha256


def test_the_bundle_stays_small() -> None:
    size = sum(p.stat().st_size for p in bundle_dir().rglob("*") if p.is_file())
    assert size < 6 * 2**20, f"data/ holds {size / 2**20:.2f} MiB"


def test_prompt_subsets_hold_what_the_readme_says() -> None:
    sharegpt = load_trace("sharegpt-conversations-2k")
    assert len(sharegpt) + sum(sharegpt.metadata["skipped"].values()) == TOOL.SHAREGPT_CONVERSATIONS
    alpaca = load_trace("alpaca-eval-2models")
    generators = [r.source for r in alpaca]
    assert sorted(set(generators)) == ["alpaca-eval/gpt4_0613", "alpaca-eval/gpt4_1106_preview"]
    assert generators.index("alpaca-eval/gpt4_0613") == generators.count("alpaca-eval/gpt4_1106_preview")


def test_regenerating_from_the_full_data_set_gives_the_committed_bundle() -> None:
    source = TOOL.default_source()
    if source is None:
        pytest.skip("the full data set is not here ($SLUICE_DATA_DIR or ../shared/data); the bundle is checked above")
    assert TOOL.check(source, bundle_dir()) == []


def test_a_loaded_trace_names_its_file_relative_to_its_data_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Results are committed: a machine's own folders must not end up in them.
    folder = tmp_path / "elsewhere"
    (folder / "traces").mkdir(parents=True)
    with open_text(data_file(AZURE_CONV)) as src:
        (folder / "traces" / "mine.csv").write_text("".join(src.readline() for _ in range(8)))
    monkeypatch.setenv("SLUICE_DATA_DIR", str(folder))
    wl = load_trace(str(folder / "traces" / "mine.csv"), num_requests=5)
    assert wl.metadata["path"] == "traces/mine.csv"
    outside = tmp_path / "outside.csv"
    assert portable_path(outside) == str(outside)
