"""The models `baton train` trains: building them on transformers' classes with an MTP head,
and writing them back in the published layout Baton's loader reads. What a family needs
(sizes, the MTP head, name prefixes, the shipped plan) its `TrainRecipe` declares
(`baton.model.family`).

Building goes through Baton's own seeded writer (`write_checkpoint`: the published names and
config.json, a scaled random init) and transformers' `from_pretrained` of that folder, so the
names and the config are exactly those of the named seeded models; `save` maps transformers'
names back (the recipe's `published_prefixes`) and adds `mtp.*`.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from baton.errors import ConfigError
from baton.model import family as families
from baton.model.family import TrainRecipe, load

VOCAB = 4096
"""Every trained model's vocabulary (one MTP layer each)."""


def recipe(family: str) -> TrainRecipe:
    """What training `family` needs (its `TrainRecipe`: sizes, the MTP head, the plan)."""
    r = families.trained()
    if family not in r:
        raise ConfigError(f"--family {family!r}: baton train trains one of {sorted(r)}")
    return r[family]


def fields(family: str, size: str) -> dict:
    r = recipe(family)
    if size not in r.sizes:
        raise ConfigError(f"--size {size!r}: {family} comes in {sorted(r.sizes)}")
    return copy.deepcopy({**r.sizes[size], "vocab_size": VOCAB, "mtp_layers": 1, **r.fields})


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
    mtp = load(recipe(family).mtp_head)(lm, config)
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
    renames = recipe(model.family).published_prefixes
    for k, v in model.lm.state_dict().items():
        if tied and k == "lm_head.weight":  # the embedding is the head (published: no copy)
            continue
        prefix = next((p for p in renames if k.startswith(p)), None)
        if prefix is not None:
            k = renames[prefix] + k[len(prefix):]
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
