"""Distilling a checkpoint's MTP head on the target's own greedy continuations (for
`baton bench spec`: a random head accepts nothing).

Data: greedy continuations of seeded random prompts (the engine, speculation off). The head
at position i reads the target hidden h_i (after norm_f) and token i+1 and learns the
target's argmax at i+1 (cross-entropy), with the target, its embedding and LM head frozen.
Training runs the head's attention as plain causal attention over the sequence (the same
function as the paged one: NemotronH attention has no positional encoding). Bounded by
wall time; the trained `mtp.*` tensors are written back under their published names.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

MARK = "mtp_distilled.json"


def _continuations(path: Path, n: int, prompt_len: int, out_len: int, seed: int) -> list:
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
    vocab = eng.model.config.vocab_size
    ps = prompts(n, prompt_len, vocab, seed=seed)
    for i, p in enumerate(ps):
        eng.add_request(Request(f"d{i}", p, SamplingParams(max_tokens=out_len, ignore_eos=True)))
    out = {f"d{i}": [] for i in range(n)}
    while eng.has_work:
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [p + out[f"d{i}"] for i, p in enumerate(ps)], eng.model


def _targets(model, seqs: torch.Tensor, group: int = 4):
    """Target hiddens [N, L, H] and argmax tokens [N, L] over every position."""
    n, L = seqs.shape
    tpb = 16
    hid, arg = [], []
    for s in range(0, n, group):
        ids = seqs[s : s + group]
        b = ids.shape[0]
        nb = -(-L // tpb)
        pools = model.make_pools(b * nb, tpb, b)
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
        h: list = []
        logits = model.prefill_batch(ids, [0] * b, tables, list(range(b)), pools,
                                     all_logits=True, hidden_out=h)
        hid.append(h[0].float())
        arg.append(logits.argmax(-1))
    return torch.cat(hid), torch.cat(arg)


def _attention(m, y: torch.Tensor) -> torch.Tensor:
    b, T, _ = y.shape
    q = m.q_proj(y).view(b, T, m.num_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(y).view(b, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
    v = m.v_proj(y).view(b, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.scale,
                                         enable_gqa=m.num_heads != m.num_kv_heads)
    return m.o_proj(out.transpose(1, 2).reshape(b, T, -1))


def _head_logits(model, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    head = model.mtp
    first = head.layers[0]
    e = first.enorm(model.backbone.embeddings(nxt))
    x = first.eh_proj(torch.cat([e, first.hnorm(h)], dim=-1))
    for layer in head.layers:
        y = layer.norm(x)
        x = x + (_attention(layer.mixer, y) if layer.attention else layer.mixer(y))
    return model.lm_head(head.layers[-1].final_layernorm(x))


def distill(path: Path, seconds: float, seed: int = 0, n: int = 48, prompt_len: int = 32,
            out_len: int = 128, batch: int = 4) -> dict:
    """Train `path`'s MTP head for about `seconds`; writes it back and returns a summary.
    Skips the work when `path` holds a head distilled before (its MARK file)."""
    mark = path / MARK
    if mark.is_file():
        return json.loads(mark.read_text())
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    seqs, model = _continuations(path, n, prompt_len, out_len, seed)
    seqs = torch.tensor(seqs, dtype=torch.long)
    with torch.inference_mode():
        hidden, arg = _targets(model, seqs)
    hidden, arg = hidden.clone(), arg.clone()  # leave inference mode: training reads them
    data_s = time.perf_counter() - t0
    # position i: (h_i, token i+1) -> the target's argmax at i+1; only positions whose
    # label is a continuation token the target chose (not a random prompt token) count
    h, nxt, y = hidden[:, :-1], seqs[:, 1:], arg[:, 1:]
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    steps, losses, t1 = 0, [], time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        idx = torch.randint(0, n, (batch,), generator=gen)
        logits = _head_logits(model, h[idx], nxt[idx])
        loss = F.cross_entropy(logits[:, prompt_len - 1 :].flatten(0, 1),
                               y[idx][:, prompt_len - 1 :].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        losses.append(float(loss.detach()))
    tensors = load_file(str(path / "model.safetensors"))
    for k, v in model.mtp.state_dict().items():
        tensors[f"mtp.{k}"] = v.detach().contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    summary = {"steps": steps, "data_seconds": round(data_s, 1),
               "train_seconds": round(time.perf_counter() - t1, 1),
               "loss_first": round(losses[0], 3) if losses else None,
               "loss_last": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 3),
               "sequences": n, "tokens": int(seqs.numel()), "seed": seed}
    mark.write_text(json.dumps(summary) + "\n")
    return summary
