"""`--tensor-parallel-size` and `worker.tensor_parallel_size` as users meet them: the rank
layout and one warning line when the ranks outnumber the cores, tokens equal to TP 1,
undividable models and remote TP ranks refused in one line naming the field, the flags
per role."""

from __future__ import annotations

import json
import logging
import os

import pytest

from baton.cli import main
from baton.config import BatonConfig
from baton.contract import Role
from baton.errors import ConfigError
from baton.model.make_model import write_checkpoint
from tests.support.engine_helpers import prompt


@pytest.fixture(scope="module")
def groups1_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tpcli") / "g1", seed=3, n_groups=1,
                            hidden_size=64, vocab_size=256, intermediate_size=128)


def _tokens(capsys) -> list[int]:
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    return lines[0]["token_ids"]


def test_tp4_on_two_cores_warns_once_prints_layout_and_matches_tp1(groups1_dir, capsys,
                                                                   caplog, monkeypatch):
    ids = ",".join(map(str, prompt(2, 9)))
    args = ["generate", "--local", "--model", str(groups1_dir), "--prompt-ids", ids,
            "--max-tokens", "6", "--json"]
    assert main(args) == 0
    want = _tokens(capsys)
    monkeypatch.setenv("BATON_NUM_THREADS", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    caplog.set_level(logging.INFO, logger="baton.tp")
    assert main([*args, "--tensor-parallel-size", "4"]) == 0
    assert _tokens(capsys) == want
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warns == ["tensor_parallel_size=4 rank processes on 2 cores: ranks share cores "
                     "(correct, not faster)"]
    ready = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    assert ready.startswith("tensor-parallel engine ready: TP 4 x PP 1 = 4 rank processes, "
                            "1 torch thread(s) each")
    assert "rank 0 pid" in ready and "(scheduler + cache manager)" in ready
    assert "rank 3 pid" in ready and "KV heads [1, 2) (replicated x2)" in ready
    assert "groups [0, 1) (replicated x4)" in ready


def test_undividable_tp_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--out", str(out), "--seed", "3"]) == 0  # n_groups 2
    capsys.readouterr()
    assert main(["generate", "--local", "--model", str(out), "--prompt-ids", "5,6",
                 "--tensor-parallel-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["baton generate: error: tensor_parallel_size=4: n_groups=2 must be a "
                   "multiple of 4 or 1 (replicated) (sizes that divide this model: 1, 2)"]


def test_config_field_per_role_and_refusals():
    cfg = BatonConfig.from_dict({"decode": {"tensor_parallel_size": 2}})
    assert cfg.worker.tensor_parallel_size == 1
    assert cfg.for_role("decode").worker.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"worker.tensor_parallel_size must be an integer "
                                          r">= 1, got 0"):
        BatonConfig.from_dict({"worker": {"tensor_parallel_size": 0}})
    both = BatonConfig.from_dict({"worker": {"tensor_parallel_size": 2,
                                             "pipeline_parallel_size": 2}}).worker
    assert (both.tensor_parallel_size, both.pipeline_parallel_size) == (2, 2)


def test_tp_workers_refuse_remote_ranks_before_loading_anything():
    from baton.worker.host import start_worker

    cfg = BatonConfig.from_dict({"worker": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"^worker.tensor_parallel_size=2: the ranks start on "
                                          r"this host \(no --pp-master with tensor "):
        start_worker(cfg, Role.DECODE, None, "127.0.0.1:1", "tiny", None, None,
                     pp_master="10.0.0.1:29500")


def test_tp_with_speculation_refused_in_one_line(groups1_dir, capsys):
    assert main(["generate", "--local", "--model", str(groups1_dir), "--prompt-ids", "5,6",
                 "--tensor-parallel-size", "2", "--speculative-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["baton generate: error: speculative.num_draft_tokens=2 is not supported "
                   "with worker.tensor_parallel_size=2 yet; set it to 0 or use "
                   "tensor_parallel_size 1"]


def test_worker_and_serve_flags_set_the_tp_size_per_role(tmp_path):
    from baton.cli import build_parser
    from baton.worker.host import _worker_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("decode: {tensor_parallel_size: 4}\n")
    parse = build_parser().parse_args
    args = parse(["decode-worker", "--router", "h:1", "--config", str(cfg)])
    assert _worker_config(args, Role.DECODE).worker.tensor_parallel_size == 4  # role section
    assert _worker_config(args, Role.PREFILL).worker.tensor_parallel_size == 1
    args = parse(["prefill-worker", "--router", "h:1", "--config", str(cfg),
                  "--tensor-parallel-size", "2"])
    assert _worker_config(args, Role.PREFILL).worker.tensor_parallel_size == 2  # flag wins
    assert parse(["serve", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
