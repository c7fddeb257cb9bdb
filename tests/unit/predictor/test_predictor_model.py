"""The trained model: the encoder export matches torch, the head learns, the predictor serves it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from predictor_service import artefacts
from predictor_service.encoder import DEFAULT_LAYERS, FULL_LAYERS
from predictor_service.export import CHECK_PROMPTS, ENCODER_TOLERANCE, check_encoder
from predictor_service.predictor import LengthPredictor


def test_encoder_onnx_matches_torch_on_a_padded_batch(tiny_predictor_dir: Path) -> None:
    path = artefacts.encoder_path(tiny_predictor_dir)
    lengths = [len(p.split()) for p in CHECK_PROMPTS]
    assert max(lengths) > 10 * min(lengths), "the check batch must be padded"
    layers = artefacts.encoder_layers(artefacts.read_config(tiny_predictor_dir))
    assert layers == DEFAULT_LAYERS < FULL_LAYERS
    assert check_encoder(path, layers=layers) <= ENCODER_TOLERANCE
    with pytest.raises(RuntimeError, match="differs from torch"):
        check_encoder(path, layers=FULL_LAYERS)  # the torch reference with all six layers is another encoder


def test_head_loss_drops_and_beats_a_constant_on_the_held_out_slice(tiny_predictor_dir: Path) -> None:
    metrics = json.loads((tiny_predictor_dir / artefacts.METRICS_FILE).read_text())
    losses = [e["train_loss"] for e in metrics["epochs"]]
    assert losses[-1] < 0.8 * losses[0], losses
    test = metrics["test"]["all"]
    assert test["n"] >= 50
    # the best constant in MAE is the median of the true lengths: beat its MAE and rank at all
    head = test["head"]
    assert head["spearman"] > 0.2, head
    assert head["mae_tokens"] < test["constant_mae_tokens"], test


def test_predictor_answers_quantiles_and_respects_max_tokens(tiny_predictor: LengthPredictor) -> None:
    preds = tiny_predictor.predict(
        ["Write a long essay about the history of Rome.", "Say yes or no."], ["chatgpt-sharegpt", "tiny-llama"], [0, 5]
    )
    assert len(preds) == 2
    for p in preds:
        levels = [q for q, _ in p.quantiles]
        values = [v for _, v in p.quantiles]
        assert levels == sorted(levels) and 0.1 in levels and 0.9 in levels
        assert values == sorted(values) and p.tokens == p.p50
        assert p.predictor_version == tiny_predictor.version and p.latency_s > 0
    assert preds[1].tokens <= 5 and preds[1].p90 <= 5


def test_mode_bin_point_lands_in_the_most_probable_bin(tiny_predictor: LengthPredictor) -> None:
    from dataclasses import replace

    from predictor_service.blend import bin_probabilities
    from predictor_service.encoder import size_features
    from sluice.contract.length_prediction import length_bucket

    prompts = ["Write a long essay about the history of Rome.", "Say yes or no.", "Explain TCP in detail."]
    predictor = tiny_predictor.with_new_history()
    predictor.blend_config = replace(predictor.blend_config, point="mode_bin")
    preds = predictor.predict(prompts, "chatgpt-sharegpt")
    emb = predictor.embed(prompts)
    _, probs = predictor.head(emb, size_features(prompts), np.array([predictor.model_index("chatgpt-sharegpt")] * 3))
    assert probs is not None and np.allclose(probs.sum(axis=1), 1.0)
    nb = predictor.history.search(["chatgpt-sharegpt"] * 3, emb, predictor.blend_config.k)
    mode = bin_probabilities(probs, nb, predictor.blend_config).argmax(axis=1)
    assert [int(length_bucket(p.tokens)) for p in preds] == mode.tolist()
    for p in preds:
        assert p.p10 <= p.p50 <= p.p90, "the quantiles stay the blend's"


def test_observe_teaches_the_next_prediction_of_the_same_prompt(tiny_predictor: LengthPredictor) -> None:
    predictor = tiny_predictor.with_new_history()
    prompt = "List every prime number below one thousand, one per line, with a short remark on each."
    before = predictor.predict([prompt], "tiny-llama")[0]
    target = 1500 if before.tokens < 600 else 20
    emb = predictor.embed([prompt])[0]
    predictor.observe(emb, "tiny-llama", target)
    after = predictor.predict([prompt], "tiny-llama")[0]
    assert abs(np.log(after.tokens / target)) < 0.5 * abs(np.log(before.tokens / target)), (before, after)
    assert after.source in ("retrieval", "blend")
    other = predictor.predict([prompt], "another-model")[0]
    assert other.tokens == before.tokens, "what one served model taught does not leak into another's"


def test_the_committed_model_is_small_and_serves_offline(predictor_cache_dir: Path) -> None:
    model_dir = artefacts.default_model_dir()
    sizes = {p.name: p.stat().st_size for p in model_dir.iterdir()}
    assert set(sizes) >= {"config.json", "head.onnx", "history.npz", "error_model.json", "metrics.json"}
    assert max(sizes.values()) < 3 * 2**20 and "encoder.onnx" not in sizes, "the encoder is exported at first use"
    predictor = LengthPredictor(model_dir)
    assert artefacts.encoder_path(model_dir).parent == predictor_cache_dir / "predictor"
    assert predictor.seed_entries > 1000 and "chatgpt-sharegpt" in predictor.history.models()
    (pred,) = predictor.predict(
        ["Write a Python function that reverses a linked list, with tests."], "chatgpt-sharegpt"
    )
    assert 1 <= pred.p10 <= pred.tokens <= pred.p90
    config = json.loads((model_dir / artefacts.MODEL_CONFIG).read_text())
    assert pred.predictor_version == config["version"]
