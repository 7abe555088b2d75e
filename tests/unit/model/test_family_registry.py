"""The family registry (baton/model/family.py) and the environment switches (baton/envs.py):
every family is found and names its parts; a model_type two families claim, an unknown one
and a family without a TP build are refused by name; every BATON_* variable the code reads
is declared, typed and documented in one place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from baton import envs
from baton.errors import ConfigError
from baton.model import family
from baton.model.config import config_from_dict

ROOT = Path(__file__).resolve().parents[2]


def test_every_built_in_family_is_found_with_its_model_types():
    by_type = {kind: s.name for s in family.specs() for kind in s.model_types}
    assert {k: v for k, v in by_type.items() if not v.startswith("toy")} == {
        "nemotron_h": "nemotron_h", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
        "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
        "qwen3_next": "qwen3_next"}
    assert family.for_model_type(None).name == "nemotron_h"  # config.json without model_type
    for spec in family.specs():  # every part it names imports
        assert spec.config_class().__name__ and spec.model_class() and spec.stage_class()
        assert callable(family.load(spec.make))


def test_an_unknown_model_type_is_refused_naming_the_served_ones():
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not served by Baton; served "
                                          r"families: \[.*'nemotron_h'.*'qwen3_next'.*\]"):
        config_from_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8})


def test_a_model_type_two_families_claim_is_refused():
    nh = family.by_name("nemotron_h")
    other = family.FamilySpec(name="other", model_types=("nemotron_h",), config=nh.config,
                              model=nh.model, stage=nh.stage, weights=nh.weights, make=nh.make)
    with pytest.raises(ConfigError, match=r"model_type 'nemotron_h' is claimed by families "
                                          r"'nemotron_h' and 'other'"):
        family.register(other)
    assert family.for_model_type("nemotron_h") is nh
    assert family.register(nh) is nh  # the same spec again: a no-op


def test_every_baton_variable_the_code_reads_is_declared_in_envs():
    declared = {e.name for e in envs.ALL}
    used = set()
    for pkg in ("baton", "router", "transfer", "prefill_worker", "decode_worker"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name != "envs.py":
                used |= set(re.findall(r"[\"'](BATON_[A-Z0-9_]+)[\"']", path.read_text()))
    assert used <= declared, sorted(used - declared)
    assert all(e.doc and e.name.startswith("BATON_") for e in envs.ALL)
    assert len(declared) == len(envs.ALL)


def test_a_switch_reads_its_type_and_default(monkeypatch):
    monkeypatch.delenv("BATON_NUM_THREADS", raising=False)
    assert envs.NUM_THREADS.get() == 0
    monkeypatch.setenv("BATON_NUM_THREADS", "3")
    assert envs.NUM_THREADS.get() == 3
    monkeypatch.setenv("BATON_FAMILY_MODULES", " a.b , c ")
    assert envs.FAMILY_MODULES.get() == ("a.b", "c")
    monkeypatch.setenv("BATON_DECODE_PATH", "slow")
    with pytest.raises(ValueError, match="BATON_DECODE_PATH must be 'fast' or 'reference'"):
        envs.DECODE_PATH.get()
