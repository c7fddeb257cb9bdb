"""Chat messages -> one prompt text, with a chat template.

    ChatTemplate.load(model, override)
        override (a file, or the template text itself)           when given (--chat-template)
        else the model folder's chat_template.jinja or tokenizer_config.json "chat_template"
        else DEFAULT_CHAT_TEMPLATE (below)
    ChatTemplate.render(messages) -> text, rendered as Hugging Face renders chat templates
        (a sandboxed Jinja environment, trim_blocks + lstrip_blocks, add_generation_prompt)

The default, for models without a template of their own (the tiny presets), is a plain
transcript the model continues: one `role: content` line per message, then `assistant:`.

NOTE: `bos_token` renders as "": the scheduler tokenizes the text with the tokenizer's own
special tokens (a BOS where the tokenizer adds one), and a template's `{{ bos_token }}` on top
would double it. `eos_token` is the tokenizer config's, for templates that close turns with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateFailed(ValueError):
    """The template refused the messages (its raise_exception, or an error while rendering)."""


def _raise_exception(message: str) -> None:
    raise TemplateFailed(message)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _model_template(model: str) -> tuple[str, str, str] | None:
    """(template, eos_token, where it came from) of a model folder that has one."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    eos = _token_text(config.get("eos_token"))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), eos, str(jinja)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str) and template:
        return template, eos, str(config_path)
    return None


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # "default", or the file it came from
    text: str
    eos_token: str = ""

    @classmethod
    def load(cls, model: str, override: str | None = None) -> ChatTemplate:
        if override:
            path = Path(override)
            if "{" not in override and path.is_file():
                return cls(str(path), path.read_text())
            if "{" not in override:
                raise ValueError(f"chat_template: no such file {override!r} (and it is not a template)")
            return cls("--chat-template", override)
        found = _model_template(model)
        if found is not None:
            text, eos, source = found
            return cls(source, text, eos)
        return cls("default", DEFAULT_CHAT_TEMPLATE)

    def __post_init__(self) -> None:
        from jinja2 import TemplateSyntaxError

        try:
            object.__setattr__(self, "_compiled", _environment().from_string(self.text))
        except TemplateSyntaxError as exc:
            raise ValueError(f"chat_template ({self.source}): {exc}") from None

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        from jinja2 import TemplateError

        try:
            return self._compiled.render(  # type: ignore[attr-defined]
                messages=list(messages), add_generation_prompt=True, bos_token="", eos_token=self.eos_token
            )
        except TemplateFailed:
            raise
        except TemplateError as exc:
            raise TemplateFailed(f"the chat template failed: {exc}") from None


def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
