"""`make ship-models` (baton.train.ship): a finished run's checkpoint is copied into the
trained models' folder (minus .train/, with the family's chat template), which the named
model then resolves to; an unfinished run, weights not in bfloat16 or a pair over 25 MB are
refused in one line, with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.errors import ConfigError
from baton.model.nemotron_h.chat_template import TEMPLATE as NEMOTRON3_TEMPLATE
from baton.model.qwen3_5.chat_template import TEMPLATE as QWEN3_5_TEMPLATE
from baton.model.registry import resolve_model
from baton.train import ship


def _fake_run(runs, name: str, family: str, dtype=torch.bfloat16):
    """A seeded checkpoint laid out as a finished `baton train` run."""
    from baton.model.make_model import write_checkpoint

    out = runs / name
    write_checkpoint(out, family=family, preset="tiny", seed=0, tokenizer=True, mtp_layers=1)
    f = out / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(f)).items()}, str(f))
    (out / ".train").mkdir()
    (out / ".train" / "state.pt").write_bytes(b"state")
    (out / "training.json").write_text(json.dumps(
        {"settings": {"family": family}, "heldout": {"loss": 1.5, "bits_per_byte": 1.9}}))
    return out


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    _fake_run(runs, "code-nemotron_h", "nemotron_h")
    _fake_run(runs, "code-qwen3_5", "qwen3_5")
    return runs


def test_ship_copies_the_runs_and_the_names_resolve_to_them(runs, tmp_path, monkeypatch,
                                                             capsys):
    dest = tmp_path / "models_data"
    assert ship.main(["--runs", str(runs), "--dest", str(dest)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("the shipped models take ")
    monkeypatch.setenv("BATON_TRAINED_DIR", str(dest))
    for name, template in (("code-nemotron_h", NEMOTRON3_TEMPLATE),
                           ("code-qwen3_5", QWEN3_5_TEMPLATE)):
        path = resolve_model(name)
        assert path == dest / name
        assert sorted(p.name for p in path.iterdir()) == sorted(
            [*ship.FILES, "tokenizer_config.json"])
        for f in ship.FILES:
            assert (path / f).read_bytes() == (runs / name / f).read_bytes()
        assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == \
            template
    assert sorted(p.name for p in dest.iterdir()) == ["code-nemotron_h", "code-qwen3_5"]


def test_unfinished_or_float32_or_too_large_runs_are_refused(runs, tmp_path, monkeypatch,
                                                             capsys):
    dest = tmp_path / "models_data"
    (runs / "code-qwen3_5" / "training.json").unlink()
    with pytest.raises(ConfigError, match=r"code-qwen3_5 is not a finished `baton train` run "
                                          r"\(no training.json\)"):
        ship.ship(runs, dest, ["code-nemotron_h", "code-qwen3_5"])
    assert not dest.exists()
    _fake_run(tmp_path / "f32", "code-qwen3_5", "qwen3_5", torch.float32)
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor '.*' is F32, the shipped "
                                          r"weights are bfloat16"):
        ship.ship(tmp_path / "f32", dest, ["code-qwen3_5"])
    monkeypatch.setattr(ship, "MAX_BYTES", 100_000)
    with pytest.raises(ConfigError, match=r"the shipped models would take .* MB, over 0 MB"):
        ship.ship(runs, dest, ["code-nemotron_h"])
    with pytest.raises(ConfigError, match="'tiny' is not a trained named model"):
        ship.ship(runs, dest, ["tiny"])
    assert not dest.exists()
    assert ship.main(["--runs", str(runs), "--dest", str(dest), "code-nemotron_h"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
