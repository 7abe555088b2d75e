"""`baton bench quality`: the reference's perplexity is transformers' on the same windows; a
variant equal to the reference has KL 0 and agrees everywhere; a bfloat16 one does not."""

from __future__ import annotations

import math

import pytest
import torch

from bench import quality

pytestmark = pytest.mark.usefixtures("model_single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from baton.model.make_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("q") / "m", seed=0, tokenizer=True)


def test_reference_is_transformers_and_variants_are_compared_with_it(model_dir):
    from transformers import AutoModelForCausalLM

    same = quality.measure(model_dir, {"model": {"dtype": "float32"}}, 64, 3)
    ref, var = same
    assert ref["tokens"] == var["tokens"] == 192 and ref["windows"] == 3
    assert var["mean_kl"] == 0.0 and var["top1_agreement"] == 1.0
    assert var["perplexity"] == ref["perplexity"]
    wins, nbytes = quality._windows(model_dir, 64, 3)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor(wins)
    with torch.no_grad():
        lg = hf(input_ids=ids[:, :-1]).logits.float()
    nll = float(torch.nn.functional.cross_entropy(lg.transpose(1, 2), ids[:, 1:],
                                                  reduction="sum"))
    assert math.isclose(ref["perplexity"], math.exp(nll / 192), rel_tol=1e-4)
    assert math.isclose(ref["bits_per_byte"], nll / math.log(2) / sum(nbytes), rel_tol=1e-4)
    _, bf16 = quality.measure(model_dir, quality.DEFAULT_VARIANT, 64, 3)
    assert 0 < bf16["mean_kl"] < 0.05 and 0.8 < bf16["top1_agreement"] < 1.0
