"""The held-out split: disjoint by group, and no prompt of val or test repeated from train."""

from __future__ import annotations

from predictor_service.data import Sample, prompt_key, split_of, split_samples


def test_val_and_test_never_hold_a_prompt_that_train_holds() -> None:
    # many groups asking the same few prompts (as ShareGPT repeats a prompt across conversations)
    samples = [Sample(f"prompt {i % 7}", 100 + i, "m", f"g{i}", "sharegpt") for i in range(400)]
    samples += [Sample(f"unique prompt {i}", 50, "m", f"u{i}", "sharegpt") for i in range(400)]
    parts = split_samples(samples)
    train = {prompt_key(s.prompt) for s in parts["train"]}
    val = {prompt_key(s.prompt) for s in parts["val"]}
    test = {prompt_key(s.prompt) for s in parts["test"]}
    assert train and val and test
    assert not (val & train) and not (test & train) and not (test & val)
    for name, part in parts.items():
        assert all(split_of(s.group) == name for s in part), "a group stays on its side"
    kept = sum(len(p) for p in parts.values())
    assert kept < len(samples), "the repeats of train prompts were dropped from val and test"
