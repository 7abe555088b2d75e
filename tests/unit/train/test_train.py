"""`baton train`: the corpus (hash, split, the committed held-out text), its refusals (one line
each) and a short run on a tiny size that lowers the held-out loss and, interrupted, resumes to
exactly the weights of an uninterrupted run; the result loads in Baton and transformers."""

from __future__ import annotations

import json
import platform
import shutil

import pytest
import torch
from safetensors.torch import load_file

from baton.errors import ConfigError
from baton.train import corpus, run
from baton.train.run import Knobs, Settings

pytestmark = pytest.mark.usefixtures("model_single_thread")

FAST = Knobs(threads=1, eval_every=1000, eval_tokens=2048, log_every=5,
             final_eval_tokens=4096, nice=0, dtype="float32")


def test_committed_heldout_matches_its_manifest_and_the_split():
    docs = corpus.heldout()
    m = corpus.manifest()
    assert {d.module for d in docs} == set(corpus.HELDOUT_MODULES) == set(m["heldout_modules"])
    assert sum(len(d.text.encode()) for d in docs) == m["heldout_bytes"] == 318811
    listed = {f[0]: f[3] for f in m["files"]}
    assert sorted(p for p, part in listed.items() if part == "heldout") == \
        sorted(d.path for d in docs)


@pytest.mark.skipif(platform.python_version() != corpus.manifest()["python"],
                    reason="the manifest was written by another Python version")
def test_this_interpreters_stdlib_is_the_manifests_corpus():
    c = corpus.scan()
    m = corpus.manifest()
    assert c.digest == m["train_sha256"] and c.train_bytes == m["train_bytes"]
    assert corpus.digest(c.heldout) == m["heldout_sha256"]
    assert not {d.module for d in c.train} & set(corpus.HELDOUT_MODULES)
    corpus.check(c, m["train_sha256"][:16])  # a 16-digit prefix is enough


def _small_corpus(root):
    """A few stdlib files (argparse marks it as a stdlib folder): a fast corpus for runs."""
    src = corpus.stdlib_root()
    for name in ("argparse.py", "bisect.py", "colorsys.py", "keyword.py", "this.py",
                 "string.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py"):
        shutil.copy(src / name, root / name)
    return root


def test_missing_or_changed_corpus_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="corpus missing: .*empty holds no Python standard"):
        corpus.scan(tmp_path / "empty")
    c = corpus.scan(_small_corpus(tmp_path))
    with pytest.raises(ConfigError, match=r"corpus changed: .* \(9 files\) hashes "
                                          f"{c.digest[:16]}, the settings expect ca91d58c"):
        corpus.check(c, corpus.manifest()["train_sha256"])
    (tmp_path / "glob.py").write_text("# edited\n")
    with pytest.raises(ConfigError, match="corpus changed"):
        corpus.check(corpus.scan(tmp_path), c.digest)
    with pytest.raises(ConfigError, match="corpus changed"):
        run.train(Settings("nemotron_h", "tiny", 4), tmp_path / "out", FAST, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = _small_corpus(tmp_path_factory.mktemp("corpus"))
    return root, corpus.scan(root).digest


def _settings(digest, family="nemotron_h", steps=12) -> Settings:
    return Settings(family, "tiny", steps, batch=4, seq=64, lr=3e-3, warmup=2,
                    corpus_hash=digest[:16])


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_a_short_run_lowers_the_loss_and_resumes_exactly(small, tmp_path, family, monkeypatch):
    root, digest = small
    s = _settings(digest, family)
    whole = run.train(s, tmp_path / "whole", FAST, root)
    log = json.loads((tmp_path / "whole" / "training.json").read_text())
    # the untrained model, evaluated the same way
    monkeypatch.setattr(run, "_loop", lambda model, opt, s, k, *a: (s.steps, []))
    fresh = run.train(s, tmp_path / "fresh", FAST, root)
    monkeypatch.undo()
    assert whole["loss"] < fresh["loss"] - 0.3, (whole, fresh)
    assert log["heldout"] == whole and log["settings"]["steps"] == 12
    assert log["log"][0]["step"] == 0 and log["log"][0]["loss"] > whole["loss"]

    # stopped after step 5 (as SIGINT would), then run again: it resumes at 5
    monkeypatch.setattr(run, "_Stop", _StopAfter5)
    with pytest.raises(KeyboardInterrupt):
        run.train(s, tmp_path / "cut", FAST, root)
    monkeypatch.undo()
    st = torch.load(tmp_path / "cut" / ".train" / "state.pt", weights_only=True)
    assert st["step"] == 5
    resumed = run.train(s, tmp_path / "cut", FAST, root)
    assert resumed == whole
    a = load_file(str(tmp_path / "cut" / "model.safetensors"))
    b = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("mtp.") for k in a)


class _StopAfter5:
    """SIGINT during step 6."""

    def __init__(self):
        self.checks = 0

    @property
    def asked(self) -> bool:
        self.checks += 1
        return self.checks > 5

    def close(self) -> None:
        pass


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_trained_checkpoint_loads_in_baton_and_transformers_alike(small, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from baton.engine.request import Request, SamplingParams
    from tests.support.engine_helpers import engine_for, run_all

    root, digest = small
    run.train(_settings(digest, family, steps=6), tmp_path / "m", FAST, root)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    prompt = [5, 300, 41, 9, 1200, 77]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                       pad_token_id=0)[0, len(prompt):].tolist()
    for spec in ({}, {"speculative": {"num_draft_tokens": 2}}):
        eng = engine_for(tmp_path / "m", **spec)
        got = run_all(eng, [Request("a", prompt, SamplingParams(max_tokens=8,
                                                                  ignore_eos=True))])
        assert got["tokens"]["a"] == want


def test_bad_runs_are_refused_in_one_line(small, tmp_path):
    root, digest = small
    s = _settings(digest, steps=4)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="output folder .*other exists and is not a baton "
                                          "train run to resume: choose a new --out"):
        run.train(s, tmp_path / "other", FAST, root)
    with pytest.raises(ConfigError, match=r"size nemotron_h tiny with 100000 steps of 4x64 "
                                          r"needs about .* over the budget of 0h01m00s"):
        run.train(_settings(digest, steps=100_000), tmp_path / "big",
                  Knobs(budget_minutes=1, nice=0), root)
    assert not (tmp_path / "big").exists()
    run.train(s, tmp_path / "done", FAST, root)
    with pytest.raises(ConfigError, match="holds a finished run"):
        run.train(s, tmp_path / "done", FAST, root)
    (tmp_path / "done" / "training.json").unlink()
    with pytest.raises(ConfigError, match=r"other settings \(steps=4 there, 8 now\)"):
        run.train(_settings(digest, steps=8), tmp_path / "done", FAST, root)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_the_trained_mtp_head_is_the_head_baton_drafts_with(small, tmp_path, family):
    """Baton's first draft after a prompt is the argmax of the training module's MTP logits at
    the prompt's last position (fed the first generated token): the same head, the same maths."""
    from baton.engine.request import Request, SamplingParams
    from baton.train import models
    from tests.support.engine_helpers import engine_for, run_all

    root, digest = small
    out = tmp_path / "m"
    run.train(_settings(digest, family, steps=8), out, FAST, root)
    model, _ = models.build(family, "tiny", 0)
    names = models.published(model, torch.float32)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == names.keys()
    missing, unexpected = model.lm.load_state_dict(
        {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
         for k, v in saved.items() if not k.startswith("mtp.")}, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if family == "qwen3_5" else [])
    assert (model.lm.lm_head.weight is model.lm.get_input_embeddings().weight) == \
        (family == "qwen3_5")  # Qwen3.5's head is its (loaded) embedding
    model.mtp.load_state_dict({k[4:]: v for k, v in saved.items() if k.startswith("mtp.")})
    model.eval()
    eng = engine_for(out, speculative={"num_draft_tokens": 1})
    first_drafts = []
    draft = eng.spec.drafter.draft
    eng.spec.drafter.draft = lambda jobs: first_drafts.append(draft(jobs)) or first_drafts[-1]
    prompts = [[5 + 37 * i % 4000, 300 + i, 41, 9 * i + 1, 1200, 77, 3 + i] for i in range(6)]
    want = []
    for i, p in enumerate(prompts):
        first_drafts.clear()
        toks = run_all(eng, [Request(f"r{i}", p, SamplingParams(max_tokens=3,
                                                                 ignore_eos=True))])["tokens"]
        ids = torch.tensor([p + toks[f"r{i}"][:1]])
        with torch.no_grad():
            h = model.lm.model(input_ids=ids[:, :-1]).last_hidden_state
            m = model.lm.lm_head(model.mtp(h, ids[:, 1:], model.lm.get_input_embeddings()))
        want.append(int(m[0, -1].argmax()))
        assert first_drafts[0] == [[want[-1]]], (i, first_drafts[0], want[-1])


def test_tokenizer_is_deterministic_and_round_trips(small):
    from baton.train import tokenizer

    root, _ = small
    c = corpus.scan(root)
    a, b = tokenizer.build(c, 1024), tokenizer.build(c, 1024)
    assert a.to_str() == b.to_str()
    text = corpus.heldout()[0].text[:5000]
    ids = a.encode(text).ids
    assert a.decode(ids) == text
    assert sum(tokenizer.token_bytes(a)[i] for i in ids) == len(text.encode())
    assert [a.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]


def test_the_command_refuses_in_one_line(tmp_path, capsys):
    from baton.cli import main

    (tmp_path / "x").mkdir()
    assert main(["train", "--family", "qwen3_5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"baton train: error: output folder {tmp_path / 'x'} exists and is not a "
                   f"baton train run to resume: choose a new --out"]
    assert main(["train", "--family", "qwen3_5", "--size", "huge", "--out",
                 str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err.strip() == \
        "baton train: error: --size 'huge': qwen3_5 comes in ['base', 'small', 'tiny']"


def test_verify_reruns_the_recorded_steps_and_lands_on_the_logged_loss(small, tmp_path,
                                                                      capsys):
    """`baton train --verify DIR --steps N` reruns the first N steps of DIR's recorded run
    (the full schedule) and compares the held-out loss with the one logged at step N; without
    --steps the whole run against the final figures. Here (same machine, one thread) exactly."""
    from baton.cli import main

    root, digest = small
    k = Knobs(threads=1, eval_every=4, eval_tokens=2048, log_every=5, final_eval_tokens=4096,
              nice=0, dtype="float32")
    out = tmp_path / "m"
    final = run.train(_settings(digest, steps=8), out, k, root)
    logged = {e["step"]: e for e in json.loads((out / "training.json").read_text())["log"]}
    r = run.verify(out, None, FAST, root)
    assert (r["step"], r["tokens"], r["loss"]) == (8, 4096, final["loss"])
    with pytest.raises(ConfigError, match=r"--steps 3: .*training.json logs the held-out loss "
                                          r"at steps \[4\] and 8 \(the end\)"):
        run.verify(out, 3, FAST, root)
    assert main(["train", "--verify", str(out), "--steps", "4", "--corpus", str(root),
                 "--nice", "0"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"verify {out}: held-out loss at step 4 (2048 tokens) "
                    f"{logged[4]['loss']:.4f} nats/token, recorded {logged[4]['loss']:.4f}: "
                    f"difference +0.0000, within 0.02")
    assert main(["train", "--verify", str(tmp_path / "none")]) == 2
    assert "no training.json there" in capsys.readouterr().err
