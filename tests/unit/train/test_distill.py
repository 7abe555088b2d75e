"""`baton train --distill-mtp`: only the head changes (the trunk's bytes are the source's),
the held-out KL to the target falls, an interrupted distillation resumes to exactly the head
of an uninterrupted one, and a folder that is not this distillation is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from baton.errors import ConfigError
from baton.train import corpus, distill, run
from baton.train.run import Knobs, Settings

pytestmark = pytest.mark.usefixtures("model_single_thread")

FAST = Knobs(threads=1, eval_every=1000, eval_tokens=1024, log_every=5,
             final_eval_tokens=2048, nice=0, dtype="bfloat16")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny NemotronH trained 6 steps on a few stdlib files (bf16, as shipped)."""
    root = tmp_path_factory.mktemp("corpus")
    src = corpus.stdlib_root()
    for name in ("argparse.py", "bisect.py", "colorsys.py", "keyword.py", "this.py",
                 "string.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py"):
        shutil.copy(src / name, root / name)
    digest = corpus.scan(root).digest
    out = tmp_path_factory.mktemp("m") / "m"
    s = Settings("nemotron_h", "tiny", 6, batch=4, seq=64, lr=3e-3, warmup=2,
                 corpus_hash=digest[:16])
    run.train(s, out, FAST, root)
    return out, root


def _settings(src, steps=6):
    return distill.DistillSettings(str(src), steps, batch=4, seq=64, lr=3e-3, warmup=2)


def test_only_the_head_changes_and_its_kl_falls(trained, tmp_path):
    src, root = trained
    ev = distill.distill(_settings(src), tmp_path / "d", FAST, root)
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert before.keys() == after.keys()
    for k, v in before.items():
        if k.startswith("mtp."):
            assert after[k].dtype == v.dtype
        else:
            assert torch.equal(after[k], v), k  # the trunk, byte for byte
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("mtp."))
    rec = json.loads((tmp_path / "d" / "distill.json").read_text())
    assert rec["heldout"] == ev and rec["log"][0]["step"] == 0
    # the same evaluation of the source head: the distilled one is closer to the target
    model, _, _ = distill.load(src)
    from tokenizers import Tokenizer

    from baton.train import data

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    held = data.stream(tok, [d.text for d in corpus.heldout()])
    base = distill.evaluate(model, held, 64, 4, FAST.final_eval_tokens)
    assert ev["tokens"] == base["tokens"] and ev["kl"] < base["kl"]
    for name in ("config.json", "tokenizer.json", "training.json"):
        assert (tmp_path / "d" / name).read_bytes() == (src / name).read_bytes()


def test_an_interrupted_distillation_resumes_exactly(trained, tmp_path, monkeypatch):
    src, root = trained
    distill.distill(_settings(src), tmp_path / "whole", FAST, root)
    with monkeypatch.context() as m:
        m.setattr(distill, "_Stop", lambda: run._StopAt(2))
        with pytest.raises(KeyboardInterrupt):
            distill.distill(_settings(src), tmp_path / "cut", FAST, root)
    assert not (tmp_path / "cut" / "distill.json").exists()
    distill.distill(_settings(src), tmp_path / "cut", FAST, root)
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_folders_that_are_not_this_distillation_are_refused(trained, tmp_path):
    src, root = trained
    with pytest.raises(ConfigError, match="no training.json there"):
        distill.distill(_settings(tmp_path), tmp_path / "x", FAST, root)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="exists and is not a distillation to resume"):
        distill.distill(_settings(src), tmp_path / "other", FAST, root)
    with pytest.raises(ConfigError, match=r"other settings \(steps=2 there, 3 now\)"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(distill, "_Stop", lambda: run._StopAt(1))
            with pytest.raises(KeyboardInterrupt):
                distill.distill(_settings(src, 2), tmp_path / "half", FAST, root)
        distill.distill(_settings(src, 3), tmp_path / "half", FAST, root)
