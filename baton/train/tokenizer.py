"""The trained models' tokenizer: byte-level BPE (`baton.model.tokenizer_build`, ids 0-2
`<pad>`, `<s>`, `</s>`) trained on the corpus's train part, with the `<|role|>` chat template.

Deterministic: the same train part and size give the same `tokenizer.json` bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from baton.model.chat_template import tokenizer_config
from baton.model.tokenizer_build import train_tokenizer
from baton.train.corpus import Corpus


def build(corpus: Corpus, vocab_size: int):
    """A `tokenizers.Tokenizer` of `vocab_size` tokens over `corpus.train`, file by file."""
    return train_tokenizer(vocab_size, (d.text for d in corpus.train))


def write(tok, out_dir: Path, max_model_len: int) -> None:
    """tokenizer.json and tokenizer_config.json (chat template) into `out_dir`, loadable by
    `transformers.AutoTokenizer` and Baton alike."""
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    cfg = {**tokenizer_config(), "tokenizer_class": "PreTrainedTokenizerFast",
           "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False,
           "clean_up_tokenization_spaces": False, "model_max_length": max_model_len}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def token_bytes(tok) -> list[int]:
    """UTF-8 bytes each id stands for (0 for special tokens): bits per byte = nats of the
    predicted tokens / ln 2 / their bytes."""
    alphabet = _byte_decoder()
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i)
        out.append(0 if s is None or s in special else sum(1 for c in s if c in alphabet))
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable characters standing for the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}
