"""Model name resolution (with racing first use) and the two tokenizers."""

from __future__ import annotations

import logging
import threading

import pytest

from baton.errors import ConfigError
from baton.model.registry import resolve_model, served_name
from baton.model.tokenizer import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("model_single_thread")


def test_tiny_is_generated_once_even_when_racing(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    results, errors = [], []

    def run():
        try:
            results.append(resolve_model("tiny"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(results) == {tmp_path / "tiny-v3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v3"]  # no temp dirs left
    assert {p.name for p in (tmp_path / "tiny-v3").iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_existing_directory_resolves_to_itself(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="neither a named model.*nor an existing directory"):
        resolve_model(str(tmp_path / "nope"))


def test_byte_fallback_round_trip_and_id_mapping(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="baton.model"):
        tok = load_tokenizer(tmp_path)
    assert "byte-level fallback" in caplog.text
    assert isinstance(tok, ByteTokenizer) and tok.name == "bytes"
    text = "Hello, wörld ✓ 🙂"
    ids = tok.encode(text)
    assert ids[:2] == [ord("H") + 3, ord("e") + 3]
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([0, 1, 2, *ids, 259, 4000]) == text  # specials and out-of-range: nothing


def test_tokenizer_json_is_used_when_present(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "baton": 3}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    with caplog.at_level(logging.INFO, logger="baton.model"):
        tok = load_tokenizer(tmp_path)
    assert "tokenizer.json" in caplog.text and "tokenizer.json" in tok.name
    assert tok.encode("hello baton world") == [1, 3, 2]
    assert tok.decode([1, 3, 2]) == "hello baton world"


def test_qwen3_5_tiny_is_a_named_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    path = resolve_model("qwen3_5-tiny")
    assert path == tmp_path / "qwen3_5-tiny-v2" and served_name(path) == "qwen3_5-tiny"
    from baton.model.config import load_config

    cfg = load_config(path)
    assert (cfg.family, cfg.pattern) == ("qwen3_5", "GGG*GGG*")
