"""The seeded models' tokenizer: deterministic bytes, every text round-trips, and transformers'
AutoTokenizer loads the folder and agrees with Baton's tokenizer id for id."""

from __future__ import annotations

import pytest

from baton.model.chat_template import load_chat_template
from baton.model.make_model import write_checkpoint
from baton.model.tokenizer import HFTokenizer, load_tokenizer
from baton.model.tokenizer_build import train_tokenizer

TEXTS = ["Hello, wörld ✓ 🙂", "The capital of France is Paris.\n\n  two  spaces\ttab",
         "Question: 2 + 2 = ?\nAnswer: 4", "<|user|>\nhi\n<|assistant|>\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tok") / "m", tokenizer=True)


def test_training_is_deterministic_and_fills_the_vocabulary(tmp_path):
    a, b = train_tokenizer(512), train_tokenizer(512)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 512
    assert [a.id_to_token(i) for i in range(3)] == ["<pad>", "<s>", "</s>"]
    one = write_checkpoint(tmp_path / "one", tokenizer=True)
    two = write_checkpoint(tmp_path / "two", tokenizer=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes()


def test_baton_uses_it_and_text_round_trips(model_dir):
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(3 <= i < 512 for i in ids)
    assert len(tok.encode("The capital of France")) == 11  # merges: fewer ids than bytes (21)


def test_transformers_autotokenizer_loads_the_folder_and_agrees(model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    ours = load_tokenizer(model_dir)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
        assert hf.encode(text) == ours.encode(text)  # no BOS/EOS added by default
        assert hf.decode(ours.encode(text)) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        load_chat_template(model_dir).render(msgs) == "<|user|>\nhi\n<|assistant|>\n"


def test_a_qwen3_5_checkpoint_keeps_its_chat_template(tmp_path):
    from transformers import AutoTokenizer

    plain = write_checkpoint(tmp_path / "plain", family="qwen3_5", pattern="GG*")
    out = write_checkpoint(tmp_path / "q", family="qwen3_5", pattern="GG*", tokenizer=True)
    msgs = [{"role": "user", "content": "hi"}]
    want = load_chat_template(plain).render(msgs)
    assert load_chat_template(out).render(msgs) == want != "<|user|>\nhi\n<|assistant|>\n"
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf.encode(TEXTS[1]) == load_tokenizer(out).encode(TEXTS[1])
