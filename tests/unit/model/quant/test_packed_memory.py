"""Memory: a worker serving a float checkpoint with `model.quantize: int8` holds its weights
packed, so the model takes at most 0.45x the resident memory its float32 form takes, and
loading never holds the float32 weights at once (each weight is packed as it is read: the
peak stays under 0.75x the float32 weights' memory).

Each side is a worker's engine built in its own process (`tests/support/rss_probe.py`); the
model's memory is that process's RSS less the RSS of the same engine over a tiny checkpoint of
the family (torch, Baton's kernels, the tokenizer, the pools' bookkeeping: about 320 MB on
the 2-core dev machine, the same for every model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.model.make_model import write_checkpoint

ROOT = Path(__file__).resolve().parents[4]
SHAPE = dict(vocab_size=300, num_attention_heads=8, num_key_value_heads=2, ssm_state_size=64,
             n_groups=2, chunk_size=64)
BIG = dict(pattern="M-M-", hidden_size=1024, intermediate_size=4096, head_dim=128,
           mamba_num_heads=32, mamba_head_dim=64, **SHAPE)  # 116 MB of float32 weights
TINY = dict(pattern="M-M-", hidden_size=64, intermediate_size=128, head_dim=8,
            mamba_num_heads=4, mamba_head_dim=16, **SHAPE)


def probes(runs: dict[str, tuple[Path, str]]) -> dict[str, dict]:
    """Each (model, mode) probed in its own process, all at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {k: subprocess.Popen([sys.executable, "-m", "tests.support.rss_probe", str(m), mode],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env, cwd=ROOT) for k, (m, mode) in runs.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out[k] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    big = write_checkpoint(root / "big", seed=1, **BIG)
    tiny = write_checkpoint(root / "tiny", seed=1, **TINY)
    return probes({"base": (tiny, "float32"), "float32": (big, "float32"),
                   "int8": (big, "int8")})


def test_int8_model_takes_under_045x_the_float32_resident_memory(sizes):
    base, f32, i8 = sizes["base"], sizes["float32"], sizes["int8"]
    model_f32 = f32["rss_kb"] - base["rss_kb"]
    model_i8 = i8["rss_kb"] - base["rss_kb"]
    assert model_f32 * 1024 > 0.9 * f32["weight_bytes"] > 100e6
    assert model_i8 <= 0.45 * model_f32, (model_i8, model_f32)
    assert i8["weight_bytes"] <= 0.3 * f32["weight_bytes"]
    # loading packed each weight as it was read: the float32 weights were never all held (the
    # peak is the packed model, the tensor being read and the huge-page move's copy: 0.36-0.5
    # of the float32 weights' memory in repeated runs)
    peak_i8 = i8["peak_anon_kb"] - base["anon_kb"]
    assert peak_i8 <= 0.75 * (f32["anon_kb"] - base["anon_kb"]), (peak_i8, f32, base)
