"""Chat messages -> prompt text with the checkpoint's `chat_template`, rendered as Hugging Face
renders it (`tokenizer_config.json`, jinja2 in a sandbox, `add_generation_prompt`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from baton.errors import ConfigError, InvalidRequestError

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The embedded tiny model's template: one `<|role|>` header line per message."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; InvalidRequestError when the template refuses the messages."""
        import jinja2

        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"messages: the chat template refused them: {e}") from e


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The template in `model_dir/tokenizer_config.json`, or None when it has none."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates, as HF stores several
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    return ChatTemplate(source, _token(cfg.get("bos_token")), _token(cfg.get("eos_token")))


def tokenizer_config(template: str = TINY_CHAT_TEMPLATE) -> dict:
    """The tokenizer_config.json that `make_model` writes beside a seeded checkpoint."""
    return {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}


def _token(value) -> str:
    if isinstance(value, dict):  # AddedToken form: {"content": "<s>", ...}
        return str(value.get("content", ""))
    return value or ""


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    if source not in _CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _CACHE[source] = env.from_string(source)
    return _CACHE[source]


def _raise(message: str):
    import jinja2

    raise jinja2.TemplateError(message)
