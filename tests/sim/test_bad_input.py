"""`sluice simulate` refuses bad input with one clear line (exit 2, `error: ...` naming the
flag, option, row or record) instead of a traceback or a silent run, and its table says how
many requests were rejected and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main

BASE = ["simulate", "--trace", "sharegpt", "--num-requests", "12", "--rate", "2", "--no-progress"]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["--max-model-len", "0"], "--max-model-len must be >= 2"),
        (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (["--kv-gb", "-1"], "--kv-gb must be > 0 GiB, got -1.0"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--swap-space-gib", "-2"], "--swap-space-gib must be >= 0"),
        (["--policy", "sarathi:budget=-5"], "option 'budget' must be >= 0, got -5"),
        (["--policy", "sarathi:budget=abc"], "option 'budget': not an integer: 'abc'"),
        (["--policy", "alise:age_threshold_s=-1"], "option 'age_threshold_s' must be >= 0"),
    ],
)
def test_bad_flag_is_refused_in_one_line_naming_it(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in refused(capsys, [*BASE, *flags])


TRACES = {
    "vidur_missing_cell.csv": (
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n100,20,120,5\n200\n",
        "row 3: column 'num_decode_tokens' is empty",
    ),
    "vidur_not_a_number.csv": (
        "num_prefill_tokens,num_decode_tokens\n100,20\nabc,5\n",
        "row 3: column 'num_prefill_tokens' is not a number: 'abc'",
    ),
    "negative_length.csv": ("num_prefill_tokens,num_decode_tokens\n100,20\n-5,30\n", "prompt length -5 must be >= 1"),
    "zero_output.csv": ("num_prefill_tokens,num_decode_tokens\n100,0\n", "output length 0 must be >= 1"),
    "unsorted.jsonl": (
        '{"timestamp": 1000, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 2000, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1500, "input_length": 10, "output_length": 5}\n',
        "record 3 (request '2'): timestamp 0.5 s comes before the previous record's 1 s",
    ),
    "negative_time.jsonl": (
        '{"timestamp": 1000, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 400, "input_length": 10, "output_length": 5}\n',
        "timestamp -0.6 s comes before",
    ),
    "zero_prompt.jsonl": ('{"timestamp": 0, "input_length": 0, "output_length": 5}\n', "prompt length 0 must be >= 1"),
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_bad_trace_is_refused_in_one_line_naming_the_record(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, says = TRACES[name]
    path = tmp_path / name
    path.write_text(text)
    err = refused(capsys, ["simulate", "--trace", str(path), "--rate", "1", "--no-progress"])
    assert str(path) in err and says in err


def test_table_says_how_many_requests_were_rejected_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    # llama-2-7b's 4096-token context: the trace's longer prompts cannot be served
    assert main([*BASE[:3], "--num-requests", "60", "--rate", "2", "--no-progress", "--max-model-len", "2048"]) == 0
    out = capsys.readouterr().out
    header, _, row = out.splitlines()[1:4]
    assert "rejected" in header.split()
    cells = row.split()
    done, rejected = cells[1], cells[2]
    finished, total = (int(x) for x in done.split("/"))
    assert total == 60 and finished < 60
    assert rejected == str(total - finished) and f"({'prompt_too_long'} {total - finished})" in row
    assert "prompt_too_long = prompt + 1 token over --max-model-len" in out
