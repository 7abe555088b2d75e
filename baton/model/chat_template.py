"""Chat messages -> prompt text with the checkpoint's `chat_template`, rendered as Hugging Face
renders it (`tokenizer_config.json`, jinja2 in a sandbox, `add_generation_prompt`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from baton.errors import ConfigError, InvalidRequestError

TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>{{ '\\n# Tools\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n</tools>\\nTo call a function reply "
    "<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n"
    "</tool_call>\\n' }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + "
    "'\\n</think>\\n' }}{% endif %}{{ message['content'] }}"
    "{% set content = message['content'] or '' %}{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '\\n' if content or not loop.first else '' }}"
    "{{ '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{% for k, v in (tool_call.arguments or {})|items %}{{ '<parameter=' + k + '>\\n' }}"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
    "{{ '\\n</parameter>\\n' }}{% endfor %}{{ '</function>\\n</tool_call>' }}{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
"""The embedded tiny model's template: one `<|role|>` header line per message."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text; InvalidRequestError when the template refuses the messages (its own
        `raise_exception` message named). `tools` and `kwargs` (`chat_template_kwargs`, such
        as `enable_thinking`) reach the template as transformers passes them."""
        import jinja2

        try:
            return _compiled(self.source).render(
                **kwargs, messages=messages, tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"messages: the chat template refused them: {e}") from e

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools` (else a request with tools is refused)."""
        return "tools" in self.source

    @property
    def call_format(self) -> str:
        """How the checkpoint writes a tool call: "xml" (`<function=NAME>`: Qwen3.5,
        Nemotron 3 and the tiny model) or "hermes" (JSON inside `<tool_call>`: Qwen3-Next)."""
        return "xml" if "<function=" in self.source else "hermes"

    @property
    def thinks(self) -> bool:
        """Whether the template opens a `<think>` block in the generation prompt."""
        return "<think>" in self.source


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
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _CACHE[source] = env.from_string(source)
    return _CACHE[source]


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson`: plain json.dumps (jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    import jinja2

    raise jinja2.TemplateError(message)
