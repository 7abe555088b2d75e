"""Incremental detokenization: the streamed pieces concatenate to the full decode, exactly."""

from __future__ import annotations

import random

import pytest

from baton.model.detokenizer import IncrementalDetokenizer
from baton.model.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = ["plain ascii", "héllo wörld", "€ 100 ≠ ∞", "日本語のテキスト", "emoji 🙂🚀 done", "a\ufffdb"]


def stream(tok, ids: list[int], cuts: list[int]) -> tuple[list[str], str]:
    """Pushes `ids` in pieces ending at `cuts`, then flushes; returns (pieces, their text)."""
    detok, pieces, start = IncrementalDetokenizer(tok), [], 0
    for end in [*cuts, len(ids)]:
        pieces.append(detok.push(ids[start:end]))
        start = end
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


def random_cuts(rng: random.Random, n: int) -> list[int]:
    return sorted(rng.sample(range(1, n), rng.randrange(0, n - 1))) if n > 1 else []


def random_ids(rng: random.Random, tok, vocab: int) -> list[int]:
    """Uniform ids (many invalid byte runs) or the encoding of mixed-script text."""
    if rng.random() < 0.5:
        return [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    words = [rng.choice(TEXTS) for _ in range(rng.randrange(1, 4))]
    return tok.encode(" ".join(words))


def test_tiny_tokenizer_stream_equals_full_decode_over_random_sequences(model_tiny_dir):
    tok = load_tokenizer(model_tiny_dir)
    assert isinstance(tok, ByteTokenizer)  # the tiny checkpoint has no tokenizer.json
    rng = random.Random(0)
    for _ in range(3000):
        ids = random_ids(rng, tok, 512)
        assert stream(tok, ids, random_cuts(rng, len(ids)))[1] == tok.decode(ids), ids


def test_one_token_at_a_time_keeps_multibyte_characters_whole():
    tok = ByteTokenizer()
    ids = tok.encode("a€b")  # € is three bytes: e2 82 ac
    pieces, text = stream(tok, ids, list(range(1, len(ids))))
    assert pieces == ["a", "", "", "€", "b", ""]
    assert text == "a€b"


def test_an_unfinished_character_is_flushed_as_the_full_decode_has_it():
    tok = ByteTokenizer()
    ids = tok.encode("ok€")[:-1]  # the stream ends inside €
    pieces, text = stream(tok, ids, [1, 2, 3])
    assert pieces == ["o", "k", "", "", "\ufffd"]
    assert text == tok.decode(ids) == "ok\ufffd"


def test_special_ids_emit_nothing_and_break_nothing():
    tok = ByteTokenizer()
    ids = [1, *tok.encode("é"), 2, 0, *tok.encode("x")]
    assert stream(tok, ids, [1, 2, 3, 4, 5])[1] == "éx"


def test_window_stays_small_on_long_answers():
    """Each push decodes only the tokens since the last emission and the emission before."""

    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids):
            Counting.decoded += len(ids)
            return super().decode(ids)

    tok = Counting()
    ids = tok.encode("streaming text, é and € included " * 40)
    stream(tok, ids, list(range(1, len(ids))))
    assert Counting.decoded <= 8 * len(ids)  # full re-decoding would be ~len(ids)**2 / 2


def test_hf_byte_level_tokenizer_stream_equals_full_decode():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator(TEXTS * 20, trainer)

    class HF:
        def decode(self, ids):
            return hf.decode(list(ids), skip_special_tokens=True)

    rng = random.Random(1)
    vocab = hf.get_vocab_size()
    for _ in range(500):
        if rng.random() < 0.5:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        else:
            ids = hf.encode(" ".join(rng.choice(TEXTS) for _ in range(3))).ids
        assert stream(HF(), ids, random_cuts(rng, len(ids)))[1] == HF().decode(ids), ids
