"""Whole chats with decode-end snapshot reuse on against off, by state format
(`baton bench precision --chats`, docs/state-precision.md).

A decode-end snapshot holds the state at a position the next turn's uninterrupted prefill
crosses inside a chunk, while the earlier turn crossed it in decode steps (and, with a 16-bit
state, rounded it there): the two need not agree in the last bits. This measures what that
does to tokens: `chats` multi-turn greedy chats, all sessions at once, each turn's prompt
the whole history plus `user_len` tokens of the held-out text (baton/train/data/heldout.jsonl,
the model's tokenizer, from offsets drawn from the chat's seed), `answer_len` greedy tokens a
turn. Every chat runs twice per state format on otherwise equal engines:

    off   mamba_state_config: no offsets from the end, no decode-end snapshot (nothing is
          reused: every turn prefills its whole history)
    on    the same with decode_end_snapshot: true (turn t+1 restores turn t's decode end)

Per format: the chats identical in every token, the turns that reused a decode end, and, for
chats that part, the reference's (off) logit margin, top-1 minus top-2, at the first differing
token, with its turn and index; `max_dlogprob` is the largest |logprob on - off| of the
chosen tokens before any parting (how far apart the bits are where the tokens agree), and
`min_margin_agreeing` the reference's smallest margin over those tokens (its closest call).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

FORMATS: dict[str, dict] = {
    "float32": {},
    "state bf16 stochastic": {"state_dtype": "bfloat16", "state_rounding": "stochastic"},
    "state bf16 nearest": {"state_dtype": "bfloat16"},
}
CHATS, TURNS, USER_LEN, ANSWER_LEN = 32, 3, 48, 32
QUICK = (8, 3, 24, 12)


def _engine(model_dir: Path, fmt: dict, decode_end: bool, chats: int, max_len: int):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    tpb = 16  # off: nothing to reuse (no snapshot is kept), so reuse is off too
    blocks = chats * (max_len // tpb + 2)
    data = {"worker": {"max_num_seqs": chats, "max_model_len": max_len + 16,
                       "max_batch_tokens": chats * (max_len + 16),
                       "prefill_chunk_size": max_len + 16},
            "cache": {"tokens_per_block": tpb, "num_blocks": 2 * blocks + 16,
                      "num_state_slots": 2 * chats + 8, "enable_prefix_reuse": decode_end,
                      "mamba_state_config": {"additional_snapshot_offsets_from_end": [],
                                             "decode_end_snapshot": decode_end},
                      **fmt}}
    return build_engine(BatonConfig.from_dict(data), str(model_dir))


def user_turns(ids: list[int], chats: int, turns: int, user_len: int,
               seed: int = 0) -> list[list[list[int]]]:
    """[chat][turn] -> `user_len` tokens of `ids` at offsets drawn from (seed, chat)."""
    out = []
    for c in range(chats):
        rng = random.Random(seed * 100_003 + c)
        out.append([ids[s : s + user_len] for s in
                    (rng.randrange(len(ids) - user_len) for _ in range(turns))])
    return out


def run_chats(engine, users: list[list[list[int]]], answer_len: int) -> list[dict]:
    """Every chat, all sessions at once, turn by turn: per chat its turns' tokens, logprob
    entries (chosen token and the top 2) and cached tokens."""
    from baton.engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=answer_len, ignore_eos=True, logprobs=2)
    res = [{"tokens": [], "logprobs": [], "cached": []} for _ in users]
    history: list[list[int]] = [[] for _ in users]
    for t in range(len(users[0])):
        ids = {}
        for c, turns in enumerate(users):
            rid = f"c{c}t{t}"
            ids[rid] = c
            engine.add_request(Request(rid, history[c] + turns[t], sp, session=f"chat{c}"))
        outs = {rid: ([], [], 0) for rid in ids}
        while engine.has_work:
            for o in engine.step():
                toks, lps, _ = outs[o.request_id]
                toks.extend(o.new_token_ids)
                lps.extend(o.logprobs)
                if o.finished:
                    outs[o.request_id] = (toks, lps, o.cached_tokens)
        for rid, c in ids.items():
            toks, lps, cached = outs[rid]
            res[c]["tokens"].append(list(toks))
            res[c]["logprobs"].append([(lp.logprob, tuple(v for _, v in lp.top[:2]))
                                       for lp in lps])
            res[c]["cached"].append(cached)
            history[c] = history[c] + users[c][t] + list(toks)
    return res


def compare(ref: list[dict], got: list[dict]) -> dict:
    """Whole-chat agreement of `got` (reuse on) with `ref` (off), and the reference's margins
    where chats part."""
    same, partings, dlp, reused = 0, [], 0.0, 0
    turns, closest = 0, float("inf")
    for r, g in zip(ref, got, strict=True):
        reused += sum(1 for t, c in enumerate(g["cached"]) if t > 0 and c > 0)
        turns += len(g["cached"]) - 1
        parted = None
        for t, (rt, gt) in enumerate(zip(r["tokens"], g["tokens"], strict=True)):
            for i, (a, b) in enumerate(zip(rt, gt, strict=True)):
                if a != b:
                    top = r["logprobs"][t][i][1]
                    parted = {"turn": t, "index": i, "margin": top[0] - top[1]}
                    break
                dlp = max(dlp, abs(r["logprobs"][t][i][0] - g["logprobs"][t][i][0]))
                top = r["logprobs"][t][i][1]
                closest = min(closest, top[0] - top[1])
            if parted:
                break
        if parted:
            partings.append(parted)
        else:
            same += 1
    margins = sorted(p["margin"] for p in partings)
    return {"chats": len(ref), "identical_chats": same, "identical_fraction": same / len(ref),
            "turns_reusing_decode_end": reused, "later_turns": turns,
            "max_dlogprob": dlp, "min_margin_agreeing": closest, "partings": partings, "parting_margins": margins,
            "max_parting_margin": max(margins, default=None)}


def run_model(model_dir: Path, chats: int = CHATS, turns: int = TURNS,
              user_len: int = USER_LEN, answer_len: int = ANSWER_LEN,
              seed: int = 0) -> list[dict]:
    """`measure` with the user turns from the held-out text when the model has a tokenizer,
    else from seeded ids (a seeded checkpoint written without one)."""
    ids = None
    if not (Path(model_dir) / "tokenizer.json").is_file():
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        ids = [rng.randrange(3, vocab) for _ in range(8192)]
    return measure(model_dir, chats, turns, user_len, answer_len, seed=seed, ids=ids)


def measure(model_dir: Path, chats: int = CHATS, turns: int = TURNS, user_len: int = USER_LEN,
            answer_len: int = ANSWER_LEN, formats: dict | None = None, seed: int = 0,
            ids: list[int] | None = None) -> list[dict]:
    """One row per state format (see the module docstring). `ids`: the text to draw the user
    turns from (None: the held-out text in the model's tokenizer)."""
    if ids is None:
        from baton.model.tokenizer import load_tokenizer
        from baton.train.corpus import heldout

        tok = load_tokenizer(model_dir)
        ids = [t for doc in heldout() for t in tok.encode(doc.text)]
    users = user_turns(ids, chats, turns, user_len, seed)
    max_len = turns * (user_len + answer_len)
    rows = []
    for name, fmt in (formats or FORMATS).items():
        ref = run_chats(_engine(model_dir, fmt, False, chats, max_len), users, answer_len)
        got = run_chats(_engine(model_dir, fmt, True, chats, max_len), users, answer_len)
        row = {"benchmark": "precision_chats", "model": str(model_dir), "variant": name,
               "turns": turns, "user_len": user_len, "answer_len": answer_len,
               **compare(ref, got)}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    import time

    import torch

    from baton.model.registry import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="named models or checkpoint folders")
    p.add_argument("--chats", type=int, default=CHATS)
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--user-len", type=int, default=USER_LEN)
    p.add_argument("--answer-len", type=int, default=ANSWER_LEN)
    p.add_argument("--seed", type=int, default=0, help="draws the user turns' offsets")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for m in a.models:
        t0 = time.monotonic()
        for row in run_model(Path(resolve_model(m)), a.chats, a.turns, a.user_len,
                             a.answer_len, a.seed):
            row["seed"] = a.seed
            row["seconds"] = round(time.monotonic() - t0, 1)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
