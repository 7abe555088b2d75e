"""`baton quantize IN OUT --to int8|int4` writes a compressed-tensors checkpoint; Baton loads
it bit-equal to `model.quantize` at load, and its logits are within 1e-4 of transformers run
on the package's own decompression of it. Norms, router, conv, SSM parameters, embeddings and
LM head stay exact; int8 keeps float32's top token where float32 leads clearly."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from baton.cli import main  # noqa: E402
from baton.errors import ConfigError  # noqa: E402
from baton.model.loader import load_model  # noqa: E402
from baton.model.make_model import write_checkpoint  # noqa: E402
from baton.model.quant import packed, weight_format  # noqa: E402
from baton.model.quant.quantize import quantizable, quantize_model, write_quantized  # noqa: E402
from baton.model.quant.served import served_format  # noqa: E402
from bench import quant_layouts  # noqa: E402
from tests.support.hf_parity import assert_logits_match, prompt_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("model_single_thread")

MODELS = {
    "nemotron_h_moe": dict(pattern="M*ME", vocab_size=300, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                           n_groups=2, chunk_size=32, moe_intermediate_size=96,
                           moe_shared_expert_intermediate_size=128),
    "qwen3_5_moe": dict(family="qwen3_5_moe", pattern="G*G", vocab_size=300, hidden_size=128,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=96,
                        shared_expert_intermediate_size=128),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def float_model(request, tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp(request.param) / "f", seed=4,
                         **MODELS[request.param])
    return d, load_model(d)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_written_checkpoint_equals_quantize_at_load_and_the_package(float_model, mode,
                                                                    tmp_path):
    src, ref = float_model
    out = write_quantized(src, tmp_path / mode, mode)
    assert weight_format(out) == served_format(src, mode) == \
        {"int8": "w8a16_channel", "int4": "w4a16_g32"}[mode]
    written = load_model(out)
    at_load = load_model(src)
    n = quantize_model(at_load, mode)
    assert n > 10
    got, want, orig = written.state_dict(), at_load.state_dict(), ref.state_dict()
    changed = []
    for k in want:  # the written checkpoint's int8 / int4 weights load packed: their bits
        assert torch.equal(packed.dense(got[k]), want[k]), k
        if not torch.equal(want[k], orig[k]):
            changed.append(k)
    # what stays exact: everything quantizable() leaves alone
    for k in orig:
        if not quantizable(k, orig[k], mode):
            assert torch.equal(want[k], orig[k]), k
    kept = [k for k in orig if any(s in k for s in ("norm", "embed", "lm_head", "conv1d",
                                                     "A_log", "dt_bias", ".gate.weight"))]
    assert kept and not set(kept) & set(changed)
    assert any("experts" in k for k in changed) and any("proj" in k for k in changed)
    # transformers on compressed-tensors' own decompression of the written checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        quant_layouts.dequantized_copy(out, tmp_path / "f32"), dtype=torch.float32).eval()
    assert_logits_match(hf, written, prompt_ids(40, seed=3), 16)


DENSE = {
    "nemotron_h": dict(pattern="M*M-", vocab_size=300, hidden_size=128, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                       chunk_size=32),
    "qwen3_5": dict(family="qwen3_5", pattern="GG*G", vocab_size=300, hidden_size=128,
                    intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16),
}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_int8_keeps_the_clear_top_token(name, tmp_path):
    # dense models: in the tiny MoE models a small change can flip a random router's choice
    src = write_checkpoint(tmp_path / name, seed=4, **DENSE[name])
    ref, q = load_model(src), load_model(src)
    quantize_model(q, "int8")
    ids = prompt_ids(200, seed=9)

    def logits(m):
        pools = m.make_pools(num_blocks=13, tokens_per_block=16, num_slots=1)
        return m.prefill(ids, 0, list(range(13)), 0, pools, all_logits=True)

    f, g = logits(ref), logits(q)
    top2 = f.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() > 100
    assert torch.equal(f.argmax(-1)[clear], g.argmax(-1)[clear])


def test_cli_quantize_and_refusals(float_model, tmp_path, capsys):
    src, _ = float_model
    out = tmp_path / "q8"
    assert main(["quantize", str(src), str(out), "--to", "int8"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == \
        "int-quantized"
    assert (out / "tokenizer_config.json").is_file()
    # already quantized; an existing output; an unknown mode
    assert main(["quantize", str(out), str(tmp_path / "again"), "--to", "int4"]) == 2
    assert "already quantized (w8a16_channel)" in capsys.readouterr().err
    assert main(["quantize", str(src), str(out), "--to", "int4"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="'int3'"):
        write_quantized(src, tmp_path / "x", "int3")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", sorted(DENSE))
def test_transformers_loads_the_written_checkpoint(name, mode, tmp_path):
    # transformers itself (through compressed-tensors) on the folder `baton quantize` wrote.
    # Dense models only: transformers 5.24 fuses MoE experts into non-Linear parameters, and
    # its compressed-tensors path does not decompress per-expert tensors into them (MoE is
    # checked above against the package's own decompression)
    src = write_checkpoint(tmp_path / name, seed=4, **DENSE[name])
    out = write_quantized(src, tmp_path / mode, mode)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_logits_match(hf, load_model(out), prompt_ids(40, seed=5), 16)
