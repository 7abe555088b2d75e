"""The models `baton train` trains: sizes, building them on transformers' classes with an MTP
head, and writing them back in the published layout Baton's loader reads.

Building goes through Baton's own seeded writer (`write_checkpoint`: the published names and
config.json, a scaled random init) and transformers' `from_pretrained` of that folder, so the
names and the config are exactly those of the named seeded models; `save` maps transformers'
names back (NemotronH: `model.` -> `backbone.`; Qwen3.5 text: the same names) and adds `mtp.*`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from baton.errors import ConfigError

VOCAB = 4096
SIZES: dict[str, dict[str, dict]] = {
    "nemotron_h": {
        "tiny": dict(pattern="M*-M", hidden_size=64, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, intermediate_size=128,
                     mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                     chunk_size=32),
        "small": dict(pattern="M-M*M-M-", hidden_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=512,
                      mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
                      chunk_size=64),
        "base": dict(pattern="M-M*M-M-M*M-", hidden_size=320, num_attention_heads=5,
                     num_key_value_heads=1, head_dim=64, intermediate_size=960,
                     mamba_num_heads=20, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
                     chunk_size=64),
    },
    "qwen3_5": {
        "tiny": dict(pattern="GG*", hidden_size=64, intermediate_size=128,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                     linear_value_head_dim=16),
        "small": dict(pattern="GGG*GGG*", hidden_size=256, intermediate_size=384,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=64, linear_value_head_dim=64),
        "base": dict(pattern="GGG*GGG*GGG*", hidden_size=320, intermediate_size=640,
                     num_attention_heads=5, num_key_value_heads=1, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64),
    },
}
"""Model sizes by family (config.json fields over the family's `tiny` preset; vocabulary
VOCAB, one MTP layer; Qwen3.5 ties its embeddings, as the published small Qwen3.5 models do).
`tiny` is for tests. The two `small` ones: 5.41M + 6.22M parameters, 23.3 MB in bf16
(the shipped pair must stay under 25 MB)."""


def fields(family: str, size: str) -> dict:
    if family not in SIZES:
        raise ConfigError(f"--family {family!r}: baton train trains one of {sorted(SIZES)}")
    if size not in SIZES[family]:
        raise ConfigError(f"--size {size!r}: {family} comes in {sorted(SIZES[family])}")
    f = {**SIZES[family][size], "vocab_size": VOCAB, "mtp_layers": 1}
    if family == "qwen3_5":
        f["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25}
        f["max_position_embeddings"] = 8192
        f["tie_word_embeddings"] = True
    else:
        f["max_position_embeddings"] = 8192
    return f


class Trainee(nn.Module):
    """transformers' causal LM plus the MTP head; `forward` gives both losses."""

    def __init__(self, family: str, lm, mtp):
        super().__init__()
        self.family, self.lm, self.mtp = family, lm, mtp

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T+1]: (mean next-token loss over T positions, mean MTP loss: position i's
        hidden with token i+1 predicting token i+2, over T-1 positions)."""
        x, y = ids[:, :-1], ids[:, 1:]
        h = self.lm.model(input_ids=x).last_hidden_state
        head = self.lm.lm_head
        loss = nn.functional.cross_entropy(head(h).flatten(0, 1).float(), y.flatten())
        m = self.mtp(h[:, :-1], y[:, :-1], self.lm.get_input_embeddings())
        mloss = nn.functional.cross_entropy(head(m).flatten(0, 1).float(), y[:, 1:].flatten())
        return loss, mloss


def build(family: str, size: str, seed: int) -> tuple[Trainee, dict]:
    """(the model, its config.json dict): seeded init, published names."""
    import transformers
    from safetensors.torch import load_file

    from baton.model.make_model import write_checkpoint

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        ck = write_checkpoint(Path(tmp) / "m", family=family, seed=seed, **fields(family, size))
        config = json.loads((ck / "config.json").read_text())
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32)
        mtp_weights = {k[4:]: v for k, v in load_file(str(ck / "model.safetensors")).items()
                       if k.startswith("mtp.")}
    if lm.config.tie_word_embeddings:
        _tied_init(lm, seed)
    if family == "nemotron_h":
        from baton.train.mtp import NemotronHMTP

        mtp = NemotronHMTP(lm.config, config["mtp_hybrid_override_pattern"])
    else:
        from baton.train.mtp import Qwen35MTP

        mtp = Qwen35MTP(lm.config, lm.model.rotary_emb)
    mtp.load_state_dict(mtp_weights, strict=True)
    return Trainee(family, lm, mtp), config


@torch.no_grad()
def _tied_init(lm, seed: int) -> None:
    """A tied table is also the LM head: the seeded writer's unit-variance embeddings make
    every position predict its own token (a held-out loss of ~19 nats), so it starts at
    std 0.02 with the final norm at scale 1, as GPT-2-style tied models do (~8.3 nats)."""
    emb = lm.get_input_embeddings().weight
    emb.copy_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
    lm.model.norm.weight.zero_()  # zero-centred: scale 1 + 0


def published(model: Trainee, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor under its published name, in `dtype`."""
    out = {}
    tied = model.lm.config.tie_word_embeddings
    for k, v in model.lm.state_dict().items():
        if tied and k == "lm_head.weight":  # the embedding is the head (published: no copy)
            continue
        if model.family == "nemotron_h" and k.startswith("model."):
            k = "backbone." + k[len("model."):]
        out[k] = v
    out.update({"mtp." + k: v for k, v in model.mtp.state_dict().items()})
    return {k: v.detach().to(dtype).contiguous() for k, v in sorted(out.items())}


def save(model: Trainee, config: dict, out: Path, dtype: torch.dtype) -> None:
    """config.json and model.safetensors (the tokenizer is written beside them elsewhere)."""
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    if "dtype" in config:
        config["dtype"] = config["torch_dtype"]
    save_file(published(model, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def num_params(model: Trainee) -> int:
    return sum(p.numel() for p in model.parameters())
