"""Chat templates of the HTTP gateway: the model's own (chat_template.jinja, else
tokenizer_config.json), an override (file or text), the documented default otherwise; a
template that refuses the messages is a 400 naming `messages`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway_service.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from gateway_service.errors import ApiError
from gateway_service.protocol import parse_chat

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _model(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_models_own_template_renders_with_a_generation_prompt_and_no_second_bos(tmp_path: Path) -> None:
    model = _model(tmp_path, {"chat_template": CHATML, "bos_token": "<s>", "eos_token": "</s>"})
    template = ChatTemplate.load(str(model))
    assert template.source.endswith("tokenizer_config.json") and template.eos_token == "</s>"
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(MESSAGES) == expected


def test_a_chat_template_file_beside_the_config_wins_and_named_templates_pick_default(tmp_path: Path) -> None:
    model = _model(
        tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    )
    assert ChatTemplate.load(str(model)).render(MESSAGES) == "D"
    (model / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")
    assert ChatTemplate.load(str(model)).render(MESSAGES) == "Hi!"


def test_the_default_template_is_a_role_transcript_ending_with_the_assistant(tmp_path: Path) -> None:
    for model in ("tiny-llama", str(_model(tmp_path, {"eos_token": "</s>"}))):
        template = ChatTemplate.load(model)
        assert (template.source, template.text) == ("default", DEFAULT_CHAT_TEMPLATE)
        assert template.render(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant:"


def test_an_override_is_a_file_or_the_template_text_and_a_broken_one_fails_at_load(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert ChatTemplate.load("tiny-llama", str(path)).render(MESSAGES) == "[system][user]"
    assert ChatTemplate.load("tiny-llama", "{{ messages | length }}").render(MESSAGES) == "2"
    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplate.load("tiny-llama", "{% for m in messages %}")
    with pytest.raises(ValueError, match="no such file"):
        ChatTemplate.load("tiny-llama", str(tmp_path / "missing.jinja"))


def test_a_template_that_raises_is_a_400_naming_messages() -> None:
    strict = ChatTemplate.load(
        "m", "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": MESSAGES}, strict)
    assert (info.value.status, info.value.param, info.value.message) == (400, "messages", "messages: user first")
    assert parse_chat({"messages": MESSAGES[1:]}, strict).prompts == [""]
