"""Each TP rank of a MoE model holds exactly its shard, and reads only that from the
checkpoint: whole experts [r*E/t, (r+1)*E/t) (`experts`) or every expert's I/t rows /
columns (`within`); the shared expert's S/t; router, Qwen's shared gate and NemotronH's
latent projections whole. Both layouts: NemotronH one tensor per expert (published, with
non-zero biases), Qwen3.5-MoE fused [E, 2I, H]. No process group is needed to load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.model import stacking, tp_loader
from baton.model.layers.parallel import TPGroup
from baton.model.loader import load_model
from baton.model.tp_loader import load_tp_model

NH = dict(pattern="ME*E", hidden_size=64, vocab_size=256, intermediate_size=128,
          mamba_head_dim=8, ssm_state_size=8, head_dim=16, chunk_size=16, n_groups=4,
          moe_latent_size=32, mlp_bias=True)
QWEN = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            full_attention_interval=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from baton.model.make_model import write_checkpoint
    from baton.model.qwen3_5.moe_make import write_checkpoint as write_qwen

    root = tmp_path_factory.mktemp("moe-tp-load")
    nh = write_checkpoint(root / "nh", seed=2, **NH)
    file = nh / "model.safetensors"
    state, gen = load_file(str(file)), torch.Generator().manual_seed(3)
    for k in [k for k in state if k.endswith(".bias") and "conv1d" not in k]:
        state[k] = torch.randn(state[k].shape, generator=gen) * 0.1  # biases exist to test
    save_file(state, str(file), metadata={"format": "pt"})
    q = write_qwen(root / "q", seed=2, **QWEN)
    return {"nemotron_h": (nh, load_model(nh)), "qwen3_5_moe": (q, load_model(q))}


class Reads:
    """safe_open that counts the elements every tensor read returns, by tensor name."""

    def __init__(self, real):
        self.real, self.elements = real, {}

    def __call__(self, *a, **kw):
        return _File(self.real(*a, **kw), self)


class _File:
    def __init__(self, f, reads):
        self.f, self.reads = f, reads

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, name):
        return _Slice(name, self.f.get_slice(name), self.reads)

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.reads.elements[name] = self.reads.elements.get(name, 0) + t.numel()
        return t


class _Slice:
    def __init__(self, name, s, reads):
        self.name, self.s, self.reads = name, s, reads

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, idx):
        t = self.s[idx]
        self.reads.elements[self.name] = self.reads.elements.get(self.name, 0) + t.numel()
        return t


def _expected(full, name: str, split: str, tp: int, r: int) -> torch.Tensor:
    """Rank r's slice of the TP-1 model's tensor `name`."""
    w = full.state_dict()[name]
    if ".experts." in name:
        e = w.shape[0]
        if split == "experts":
            return w[r * e // tp:(r + 1) * e // tp]
        if name.endswith("down_proj"):
            i = w.shape[2]
            return w[:, :, r * i // tp:(r + 1) * i // tp]
        halves = w.chunk(2, dim=1) if name.endswith("gate_up_proj") else (w,)
        return torch.cat([h[:, r * h.shape[1] // tp:(r + 1) * h.shape[1] // tp]
                          for h in halves], dim=1)
    if ".shared_expert." in name or ".shared_experts." in name:
        if "down_proj.weight" in name:
            return w[:, r * w.shape[1] // tp:(r + 1) * w.shape[1] // tp]
        if "down_proj.bias" in name:
            return w
        return w[r * w.shape[0] // tp:(r + 1) * w.shape[0] // tp]
    return w  # router, shared gate, latent projections: replicated


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe"])
@pytest.mark.parametrize("split", ["experts", "within"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_holds_and_reads_only_its_expert_shard(models, monkeypatch, family, split, tp):
    path, full = models[family]
    moe_names = [k for k in full.state_dict() if any(
        s in k for s in (".experts.", "shared_expert", ".gate.", "latent_proj"))]
    for r in range(tp):
        reads = Reads(stacking.safe_open)
        monkeypatch.setattr(stacking, "safe_open", reads)
        monkeypatch.setattr(tp_loader, "safe_open", reads)
        model = load_tp_model(path, TPGroup(r, tp), moe_split=split)
        mine = model.state_dict()
        for name in moe_names:
            want = _expected(full, name, split, tp, r)
            assert torch.equal(mine[name], want), f"rank {r}: {name}"
        held = sum(v.numel() for k, v in mine.items() if ".experts." in k)
        read = sum(n for k, n in reads.elements.items() if ".experts." in k)
        assert held > 0 and read == held, f"rank {r} read {read} expert elements, holds {held}"


class Capture(TPGroup):
    """A rank without peers: its all-reduce input is kept and zeros come back, so the
    layer's output is what it adds after the reduce (the biases)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.partials: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.partials.append(t.clone())
        return torch.zeros_like(t)


def _moe_layers(model):
    return [m for m in model.modules() if hasattr(m, "routed_tokens")]


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5_moe"])
@pytest.mark.parametrize("split", ["experts", "within"])
@pytest.mark.parametrize("tp", [2, 4])
@torch.inference_mode()
def test_rank_partials_sum_to_the_tp1_layer(models, family, split, tp):
    """Every MoE layer: the ranks' single all-reduce inputs sum, plus what a rank adds after
    it, to the TP-1 layer's output (1e-12 abs, in float64: in float32 the reordered sums of
    outputs about 8-11 in size differ by a few of their ulps, 1e-6 each, as this CPU's BLAS
    rounds them); the routing counts equal TP 1's."""
    path, _ = models[family]
    full = load_model(path, dtype=torch.float64)
    x = torch.randn(37, full.config.hidden_size, generator=torch.Generator().manual_seed(9),
                    dtype=torch.float64)
    groups = [Capture(r, tp) for r in range(tp)]
    ranks = [_moe_layers(load_tp_model(path, g, dtype=torch.float64, moe_split=split))
             for g in groups]
    for i, ref in enumerate(_moe_layers(full)):
        seen = ref.routed_tokens.clone()  # the shared TP-1 model counts every test's calls
        want = ref(x)
        outs = [layers[i](x) for layers in ranks]
        assert all(len(g.partials) == i + 1 for g in groups)  # one reduce per layer
        got = sum(g.partials[i] for g in groups) + outs[0]
        assert all(torch.equal(o, outs[0]) for o in outs)
        err = float((got - want).abs().max())
        assert err < 1e-12, f"layer {ref.layer_idx}: {err:.3g}"
        assert all(torch.equal(layers[i].routed_tokens, ref.routed_tokens - seen)
                   for layers in ranks)


def test_missing_expert_named_by_its_checkpoint_id_on_the_rank_that_needs_it(models,
                                                                             tmp_path):
    import shutil

    from baton.errors import ConfigError

    src = models["nemotron_h"][0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    state = load_file(str(bad / "model.safetensors"))
    gone = "backbone.layers.1.mixer.experts.5.up_proj.weight"
    del state[gone]
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    load_tp_model(bad, TPGroup(0, 2))  # experts 0..3: not its expert, not read
    with pytest.raises(ConfigError) as e:
        load_tp_model(bad, TPGroup(1, 2))
    assert str(e.value) == (f"checkpoint is missing tensor {gone!r} (expert 5 for "
                            "'backbone.layers.1.mixer.experts.up_proj', experts 4..7 on this "
                            "rank)")
