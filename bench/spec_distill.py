"""Distilling a checkpoint's MTP head on what its target computes (for `baton bench spec`: a
random head accepts nothing).

The head at position i reads the target hidden h_i (after norm_f) and the token t_{i+1} and
should give the target's next hidden h_{i+1} (its argmax is the target's next token, and it
is the hidden the head's next draft step reads: serving chains the head on its own output).
Why not gradient descent on the greedy continuations alone (what this file did first): on
the 2-core dev machine a 100m target decodes ~13 tokens/s and one Adam step of the head over
8 x 160 positions takes seconds, so the bench's few minutes gave ~60 steps over ~2k labels
of a 16384-token vocabulary: the head memorised them (train loss 0.04) and accepted 5% of its
first drafts on held-out prompts. Measured on 64 continuations of the 100m target: 4779
distinct tokens in 8192, t_{i+2} follows from t_{i+1} alone 18% of the time (a bigram table,
held out), so what generalises is the smooth part of the target's map, and that is data
hungry. So:

    data   the target's hiddens over seeded random token sequences in one prefill forward
           each (the bench's prompts are random tokens too, other seeds), every position a
           sample: ~3x cheaper per sample than decoding continuations, and a ridge fit on
           them predicts held-out continuations as well as one on continuations
    fit    closed form, least squares with a ridge: eh_proj maps [enorm(e), hnorm(h)] to
           h_{i+1}; the attention block's o_proj is zeroed (the head's KV path still runs);
           an MLP block keeps the target's first MLP's up_proj as features and its
           down_proj is fitted to what eh_proj leaves; final norms 1
    tune   Adam on the regression loss (+ 0.1 x cross-entropy on the target's argmax) for
           the rest of the time, kept only while it raises the first-draft accuracy on 4
           held-out continuations (the tiny gains; the 100m, a few steps in, does not)

Bounded by wall time (data `data_share` of `seconds`, at least the `greedy` continuations;
tuning the remainder; the bench: 6 minutes for the 100m, 1.5 for the tiny); the fitted `mtp.*`
tensors are written back under their published names.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

MARK = "mtp_distilled.json"
RIDGE = 10.0
"""Ridge of the least-squares fits (the held-out accuracy is flat from 1 to 100)."""
SEQ_LEN = 160
OUT_LEN = 128
"""Greedy continuations: 32 prompt tokens, then 128 the target chose."""
SEED_BASE = 10_000
"""Prompt seeds of the data start here: never the seeds the bench measures on (100 + n)."""


def _hiddens(model, seqs: torch.Tensor) -> torch.Tensor:
    """Final-normed target hiddens [n, L, H] of token sequences [n, L] (one prefill each)."""
    n, L = seqs.shape
    tpb = 16
    nb = -(-L // tpb)
    pools = model.make_pools(n * nb, tpb, n)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(n)]
    h: list = []
    model.prefill_batch(seqs, [0] * n, tables, list(range(n)), pools, hidden_out=h)
    return h[0].float()


def _continuations(path: Path, n: int, prompt_len: int, out_len: int, seed: int):
    """Greedy continuations [n, prompt_len + out_len] of seeded random prompts (the engine,
    speculation off): what the head drafts on when serving."""
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.engine.request import Request, SamplingParams
    from bench.common import prompts

    total = prompt_len + out_len
    cfg = BatonConfig.from_dict({
        "cache": {"enable_prefix_reuse": False, "num_blocks": n * (total // 16 + 2) + 16,
                  "num_state_slots": n + 1},
        "worker": {"max_num_seqs": n, "max_model_len": total + 1},
    })
    eng = build_engine(cfg, str(path))
    ps = prompts(n, prompt_len, eng.model.config.vocab_size, seed=SEED_BASE - 1 - seed)
    for i, p in enumerate(ps):
        eng.add_request(Request(f"d{i}", p, SamplingParams(max_tokens=out_len, ignore_eos=True)))
    out = {f"d{i}": [] for i in range(n)}
    while eng.has_work:
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return torch.tensor([p + out[f"d{i}"] for i, p in enumerate(ps)])


def _data(model, path: Path, seconds: float, seed: int, greedy: int, group: int = 4,
          max_seqs: int = 128):
    """(sequences [n, L], hiddens [n, L, H]): `greedy` continuations first, then seeded
    random sequences, a group at a time until `seconds` have passed."""
    from bench.common import prompts

    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    seqs = list(_continuations(path, greedy, SEQ_LEN - OUT_LEN, OUT_LEN, seed))
    hid = []
    for s in range(0, greedy, group):
        with torch.inference_mode():
            hid.extend(_hiddens(model, torch.stack(seqs[s : s + group])).clone())
    while len(seqs) < max_seqs and time.perf_counter() - t0 < seconds:
        ids = torch.tensor(prompts(group, SEQ_LEN, vocab, seed=SEED_BASE + seed * 1000 +
                                   len(seqs)))
        with torch.inference_mode():
            hid.extend(_hiddens(model, ids).clone())
        seqs.extend(ids)
    return torch.stack(seqs), torch.stack(hid)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ridge(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """argmin_A |XA - Y|^2 + RIDGE |A|^2, in float64."""
    X, Y = X.double(), Y.double()
    gram = X.T @ X + RIDGE * torch.eye(X.shape[1], dtype=X.dtype)
    return torch.linalg.solve(gram, X.T @ Y).float()


def _first_mlp(model):
    for block in model.backbone.layers:
        if type(block.mixer).__name__ == "MLP":
            return block.mixer
    return None


@torch.no_grad()
def _fit(model, seqs: torch.Tensor, hid: torch.Tensor) -> None:
    """The closed-form head (see the module docstring) from samples (h_i, t_{i+1}) -> h_{i+1}."""
    head, embed = model.mtp, model.backbone.embeddings
    first, eps = head.layers[0], model.config.layer_norm_epsilon
    for name, mod in head.named_modules():
        if name.endswith("norm"):
            mod.weight.fill_(1.0)
    X = torch.cat([_rms(embed(seqs[:, 1:]), eps), _rms(hid[:, :-1], eps)], -1).flatten(0, 1)
    Y = hid[:, 1:].flatten(0, 1)
    A = _ridge(X, Y)
    first.eh_proj.weight.copy_(A.T)
    x = X @ A
    for layer in head.layers:
        if layer.attention:
            layer.mixer.o_proj.weight.zero_()
        elif type(layer.mixer).__name__ == "MLP":
            src = _first_mlp(model)
            if src is not None and src.up_proj.weight.shape == layer.mixer.up_proj.weight.shape:
                layer.mixer.up_proj.weight.copy_(src.up_proj.weight)
            feats = layer.mixer.act(layer.mixer.up_proj(_rms(x, eps)))
            layer.mixer.down_proj.weight.copy_(_ridge(feats, Y - x).T)
            x = x + layer.mixer.down_proj(feats)


def _attention(m, y: torch.Tensor) -> torch.Tensor:
    """The head's attention as plain causal attention over the sequence (NemotronH attention
    has no positional encoding: the same function as the paged one)."""
    b, T, _ = y.shape
    q = m.q_proj(y).view(b, T, m.num_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(y).view(b, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
    v = m.v_proj(y).view(b, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.scale,
                                         enable_gqa=m.num_heads != m.num_kv_heads)
    return m.o_proj(out.transpose(1, 2).reshape(b, T, -1))


def _head_out(model, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The head's output hidden over whole sequences: h [n, T, H], nxt [n, T]."""
    head = model.mtp
    first = head.layers[0]
    e = first.enorm(model.backbone.embeddings(nxt))
    x = first.eh_proj(torch.cat([e, first.hnorm(h)], dim=-1))
    for layer in head.layers:
        y = layer.norm(x)
        x = x + (_attention(layer.mixer, y) if layer.attention else layer.mixer(y))
    return head.layers[-1].final_layernorm(x)


@torch.no_grad()
def accuracy(model, seqs: torch.Tensor, hid: torch.Tensor) -> float:
    """First-draft accuracy over continuations: the head's argmax at i (a continuation
    position) equals the target's at i+1."""
    out = _head_out(model, hid[:, :-1], seqs[:, 1:])[:, SEQ_LEN - OUT_LEN - 1 :]
    want = model.lm_head(hid[:, SEQ_LEN - OUT_LEN :]).argmax(-1)
    return float(model.lm_head(out).argmax(-1).eq(want).float().mean())


def _tune(model, seqs, hid, held, seconds: float, seed: int) -> tuple[int, float]:
    """Adam for `seconds`, keeping the head that scores best held out; (steps, best)."""
    head = model.mtp
    best, best_state = accuracy(model, *held), {k: v.clone() for k, v in
                                                head.state_dict().items()}
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        idx = torch.randint(0, seqs.shape[0], (4,), generator=gen)
        out, want = _head_out(model, hid[idx, :-1], seqs[idx, 1:]), hid[idx, 1:]
        with torch.no_grad():
            label = model.lm_head(want).argmax(-1)
        loss = (out - want).pow(2).mean() + 0.1 * F.cross_entropy(
            model.lm_head(out).flatten(0, 1), label.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps % 25 == 0:
            acc = accuracy(model, *held)
            if acc > best:
                best, best_state = acc, {k: v.detach().clone()
                                         for k, v in head.state_dict().items()}
    for p in params:
        p.requires_grad_(False)
    head.load_state_dict(best_state)
    return steps, best


def distill(path: Path, seconds: float, seed: int = 0, greedy: int = 12,
            data_share: float = 0.5) -> dict:
    """Fit `path`'s MTP head in about `seconds` (`data_share` of it for data, at least the
    `greedy` continuations, 4 of them held out; the rest tuning);
    writes it back and returns a summary. Skips the work when `path` holds a head distilled
    before (its MARK file)."""
    from baton.model.loader import load_model

    mark = path / MARK
    if mark.is_file():
        return json.loads(mark.read_text())
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = load_model(path)
    for p in model.parameters():
        p.requires_grad_(False)
    seqs, hid = _data(model, path, seconds * data_share, seed, greedy)
    # the first 4 continuations are held out: what the tuning is judged on
    held, seqs, hid = (seqs[:4], hid[:4]), seqs[4:], hid[4:]
    data_s = time.perf_counter() - t0
    _fit(model, seqs, hid)
    fit_acc = accuracy(model, *held)
    fit_s = time.perf_counter() - t0 - data_s
    # the tuning sees the continuations only (the distribution drafts meet), if any
    g = greedy - 4 or seqs.shape[0]
    steps, acc = _tune(model, seqs[:g], hid[:g], held, seconds - (time.perf_counter() - t0),
                       seed)
    tensors = load_file(str(path / "model.safetensors"))
    for k, v in model.mtp.state_dict().items():
        tensors[f"mtp.{k}"] = v.detach().contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    summary = {"steps": steps, "data_seconds": round(data_s, 1), "fit_seconds": round(fit_s, 1),
               "seconds": round(time.perf_counter() - t0, 1), "sequences": int(seqs.shape[0]),
               "greedy_sequences": greedy - 4, "samples": int(seqs.shape[0] * (SEQ_LEN - 1)),
               "heldout_acc_fit": round(fit_acc, 4), "heldout_acc": round(acc, 4),
               "seed": seed}
    mark.write_text(json.dumps(summary) + "\n")
    return summary
