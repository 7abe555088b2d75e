"""The trained named models `code-nemotron_h` and `code-qwen3_5` (docs/training.md): the
shipped folders load (bf16, MTP head, tokenizer, a chat template with tools, 25 MB together),
and Baton equals transformers on held-out prompts: logits at every position within 1e-4 and
greedy tokens identical. Skipped, saying how to make them, while they are not shipped. The
speculation identity tests run on them too (tests/unit/engine/speculative/)."""

from __future__ import annotations

import json

import pytest
import torch

from baton.engine.request import Request
from baton.errors import ConfigError
from baton.model.registry import TRAINED, resolve_model, trained_dir
from tests.support.engine_helpers import engine_for, greedy, run_all
from tests.support.trained import NAMES, heldout_prompts, shipped

pytestmark = pytest.mark.usefixtures("model_single_thread")

MAX_ERR = 1e-4
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "training.json"}


def test_an_unshipped_name_fails_in_one_line_saying_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_TRAINED_DIR", str(tmp_path))
    for name in NAMES:
        with pytest.raises(ConfigError) as e:
            resolve_model(name)
        assert str(e.value) == (
            f"model {name!r} is not shipped in this checkout ({tmp_path / name} holds no "
            f"checkpoint): train it with `make train-models` (about 2 hours), then "
            f"`make ship-models` copies it there")


@pytest.mark.parametrize("name", NAMES)
def test_shipped_checkpoint_loads(name):
    from safetensors import safe_open

    from baton.model.chat_template import load_chat_template
    from baton.model.loader import load_model
    from baton.model.tokenizer import load_tokenizer
    from baton.train.corpus import heldout

    path = shipped(name)
    assert path == trained_dir() / name
    assert {p.name for p in path.iterdir()} == FILES
    record = json.loads((path / "training.json").read_text())
    assert record["settings"]["family"] == TRAINED[name]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert any(k.startswith("mtp.") for k in f.keys())  # noqa: SIM118
    assert dtypes == {"BF16"}
    model = load_model(path)
    assert model.mtp is not None
    tok = load_tokenizer(path)
    text = heldout()[0].text[:3000]
    assert tok.decode(tok.encode(text)) == text
    template = load_chat_template(path)
    assert template.supports_tools and template.call_format == "xml"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert "<|im_start|>assistant" in template.render(
        [{"role": "user", "content": "hi"}], tools=tools)


def test_the_shipped_pair_takes_at_most_25_mb():
    sizes = [sum(p.stat().st_size for p in shipped(n).iterdir()) for n in NAMES]
    assert sum(sizes) <= 25_000_000, sizes


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    from transformers import AutoModelForCausalLM

    from baton.model.tokenizer import load_tokenizer

    path = shipped(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf, heldout_prompts(load_tokenizer(path), 4, 48)


def test_logits_at_every_position_equal_transformers(pair):
    path, hf, prompts = pair
    eng = engine_for(path)
    for i, p in enumerate(prompts):
        rid = f"p{i}"
        adm = eng.cache.admit(rid, p, reuse=False)
        try:
            eng.cache.ensure_blocks(rid, len(p))
            got = eng.model.prefill(torch.tensor(p), 0, eng.cache.block_table(rid), adm.slot,
                                    eng.pools, all_logits=True).float()
        finally:
            eng.cache.abort(rid)
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        err = (got - want).abs().max().item()
        assert err < MAX_ERR, (i, err)


def test_greedy_tokens_equal_transformers_on_heldout_prompts(pair):
    path, hf, prompts = pair
    eng = engine_for(path, worker={"max_num_seqs": 4})
    got = run_all(eng, [Request(f"p{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist()
        assert got["tokens"][f"p{i}"] == want, i
