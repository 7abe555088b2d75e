"""`--speculative-tokens` on `serve`, the workers and `generate --local`: it sets
`speculative.num_draft_tokens` alone, every other key of the config file's section stays."""

from __future__ import annotations

import argparse

import pytest

from baton.cli import build_parser
from baton.cluster.local import _worker_flags
from baton.commands import _with_speculation
from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.worker.host import Role, _worker_config

FILE = "speculative:\n  num_draft_tokens: 1\n  max_batch: 0\n"
TREE = "speculative:\n  num_draft_tokens: 2\n  max_batch: 5\n  tree:\n    top_k: [2, 1]\n"


@pytest.fixture
def config(tmp_path):
    def write(text: str) -> str:
        p = tmp_path / "c.yaml"
        p.write_text(text)
        return str(p)
    return write


def test_every_serving_command_takes_the_flag():
    ap = build_parser()
    for argv in (["serve"], ["prefill-worker", "--router", "h:1"],
                 ["decode-worker", "--router", "h:1"], ["generate", "--local", "--prompt", "x"]):
        assert ap.parse_args([*argv, "--speculative-tokens", "3"]).speculative_tokens == 3
        assert ap.parse_args(argv).speculative_tokens is None


def test_the_flag_overrides_its_own_key_only(config):
    cfg = BatonConfig.load(config(FILE))
    out = _with_speculation(cfg, 3)
    assert (out.speculative.num_draft_tokens, out.speculative.max_batch) == (3, 0)
    tree = BatonConfig.load(config(TREE))
    out = _with_speculation(tree, 2)
    assert out.speculative.tree == tree.speculative.tree and out.speculative.max_batch == 5
    off = _with_speculation(tree, 0)  # off drops the tree (it needs K > 0), keeps max_batch
    assert off.speculative.tree is None and off.speculative.max_batch == 5
    with pytest.raises(ConfigError, match="top_k has 2 depths but speculative.num_draft_tokens=3"):
        _with_speculation(tree, 3)
    with pytest.raises(ConfigError, match=r"num_draft_tokens must be an integer in 0..8 .* got 9"):
        _with_speculation(cfg, 9)


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_workers_apply_the_flag_over_the_file(config, role):
    args = argparse.Namespace(config=config(FILE), speculative_tokens=3)
    cfg = _worker_config(args, role)
    assert (cfg.speculative.num_draft_tokens, cfg.speculative.max_batch) == (3, 0)
    args.speculative_tokens = None
    assert _worker_config(args, role).speculative.num_draft_tokens == 1


def test_serve_passes_the_flag_to_every_worker_and_refuses_a_bad_one(config):
    args = argparse.Namespace(config=config(FILE), speculative_tokens=3, tensor_parallel_size=None)
    assert _worker_flags(args) == ("--speculative-tokens", "3")
    args.tensor_parallel_size = 2
    assert _worker_flags(args) == ("--tensor-parallel-size", "2", "--speculative-tokens", "3")
    args.speculative_tokens = 9
    with pytest.raises(ConfigError, match="got 9"):
        _worker_flags(args)
    args.speculative_tokens, args.tensor_parallel_size = None, None
    assert _worker_flags(args) == ()
