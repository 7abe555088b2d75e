"""Trains the seeded models' Hugging Face tokenizer: byte-level BPE on `tokenizer_corpus`.

Deterministic: the same corpus and vocabulary size give the same `tokenizer.json` bytes (one
training thread, no randomness in the trainer). Ids 0, 1, 2 are `<pad>`, `<s>`, `</s>`, as the
checkpoints' config.json says; every byte has a token, so any text round-trips. A vocabulary
larger than the corpus supports stops early: the model's embedding rows past the tokenizer's
last id are simply never produced by encoding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from baton.model.chat_template import tokenizer_config
from baton.model.tokenizer_corpus import CORPUS

SPECIAL = ["<pad>", "<s>", "</s>"]


def train_tokenizer(vocab_size: int, texts=None):
    """A `tokenizers.Tokenizer` of at most `vocab_size` tokens, trained on `texts` (an
    iterable of strings; default: `tokenizer_corpus`'s lines)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = CORPUS.splitlines(keepends=True) if texts is None else texts
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(out_dir: str | Path, vocab_size: int, max_model_len: int) -> None:
    """`tokenizer.json` and `tokenizer_config.json` (with the chat template: the one already
    there, else the tiny one) into `out_dir`,
    loadable by `transformers.AutoTokenizer.from_pretrained(out_dir)`."""
    out = Path(out_dir)
    tok = train_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    existing = out / "tokenizer_config.json"  # a family's own chat template is kept
    base = json.loads(existing.read_text()) if existing.is_file() else tokenizer_config()
    cfg = {**base, "tokenizer_class": "PreTrainedTokenizerFast",
           "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "model_max_length": max_model_len}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
