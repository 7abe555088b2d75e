"""Checkpoints for speculative-decoding tests: a tiny NemotronH with a dense MTP head (`*-`),
and one whose head is built to agree with the target most of the time."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.engine_helpers import make_checkpoint

AGREE_ALPHA = 0.3
"""Residual outputs of the target scaled by this: the target stays close to a bigram model of
its embeddings, which the built head predicts exactly (about 45% of drafts accepted at K=3)."""


def agreeing_checkpoint(root: Path, name: str = "tiny_mtp_agree", alpha: float = AGREE_ALPHA,
                        **fields):
    """The MTP head predicts argmax lm_head(norm(embed(t))) for the token t it is fed (eh_proj
    takes the embedding half, its mixers add nothing); the target's layers are shrunk so it
    mostly predicts the same, with context-dependent exceptions (rejected drafts). `fields`:
    config overrides (a pattern with `E` gets a MoE `*E` head)."""
    ck = make_checkpoint(root, name, mtp_layers=1, **fields)
    f = ck / "model.safetensors"
    t = load_file(str(f))
    outs = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")
    for k in list(t):
        if k.startswith("backbone.") and k.endswith(outs):
            t[k] = t[k] * alpha
    H = t["mtp.layers.0.eh_proj.weight"].shape[0]
    t["mtp.layers.0.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    for k in [k for k in t if k.startswith("mtp.") and k.endswith(outs)]:
        t[k] = torch.zeros_like(t[k])  # the head's blocks add nothing
    save_file(t, str(f), metadata={"format": "pt"})
    return ck


def agreeing_qwen_checkpoint(root: Path, name: str = "tiny_qwen_mtp_agree",
                             alpha: float = AGREE_ALPHA):
    """The Qwen3.5 version: `mtp.fc` takes the (unscaled) embedding half, the head's layer adds
    nothing and `mtp.norm` is the target's final norm, so the head predicts argmax
    lm_head(norm(embed(t))); the target's residual outputs are shrunk by `alpha`."""
    ck = make_checkpoint(root, name, family="qwen3_5", mtp_layers=1)
    f = ck / "model.safetensors"
    t = load_file(str(f))
    for k in list(t):
        if k.startswith("model.") and k.endswith(
                ("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            t[k] = t[k] * alpha
    H = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    t["mtp.norm.weight"] = t["model.norm.weight"].clone()
    for k in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        t[k] = torch.zeros_like(t[k])
    save_file(t, str(f), metadata={"format": "pt"})
    return ck
