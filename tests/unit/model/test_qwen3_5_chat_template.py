"""The Qwen3.5 chat template `make-model --family qwen3_5` ships renders as transformers
renders it (roles, system message, generation prompt opening the thinking block)."""

from __future__ import annotations

import pytest

from baton.model.chat_template import load_chat_template
from baton.model.qwen3_5.make import QWEN_CHAT_TEMPLATE, write_checkpoint

chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("qchat"), seed=0, num_hidden_layers=1,
                            full_attention_interval=1)
    return load_chat_template(path)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", CHATS, ids=["one", "multi"])
def test_template_renders_as_transformers(template, messages, gen):
    ours = template.render(messages, add_generation_prompt=gen)
    rendered, _ = chat_utils.render_jinja_template(
        conversations=[messages], chat_template=QWEN_CHAT_TEMPLATE, add_generation_prompt=gen)
    assert ours == rendered[0]
    assert ours.startswith(f"<|im_start|>{messages[0]['role']}\n")
    assert ours.endswith("<|im_start|>assistant\n<think>\n") == gen
