"""The family registry: one `FamilySpec` per model family, looked up by `config.json`'s
`model_type` (aliases included) or by a loaded config's `family`.

A family is one folder under `baton/model/` with a `family.py` that calls `register` (found
by scanning this package's subpackages: nothing here names one), or any module named in
`BATON_FAMILY_MODULES` (see `baton.envs`) that does the same, e.g. a test's family. The spec
names everything else by `"module:attribute"` string, imported on first use, so reading a
config (the router, the CLI) never loads torch.

What the named parts must answer (the engine probes none of it with getattr):

    config      class: `from_dict(d)`, frozen; `family` (the spec's name), `num_layers`,
                `pattern`, `attention_layers`, `state_layers`, `state_tensors`, KV heads and
                `head_dim`, `vocab_size`, `hidden_size`, `tie_word_embeddings`, special token
                ids, `raw`; `tp_rules()` (field, value, rule) and `tp_layout()` (label, units)
    model       class(config): `baton.model.protocol.CausalLM`
    stage       class(config, layers, first, last): `baton.model.protocol.Stage`
    tp          module (or None: no tensor parallelism): `local_config(cfg, tp, moe_split)`,
                `sections(cfg, what)`, `RULES`, `MOE_RULES`, `parallelize(cfg, tp, blocks,
                moe_split)` (its layers' modules that talk over the group)
    mtp         function(config) -> the MTP head module the config declares, or None
    make        function(out_dir, *, preset, seed, **fields) -> out_dir (a seeded checkpoint)
    chat_template  str (or None): the family's published chat template with tool calls,
                which a checkpoint of the family ships (a trained model's, `baton.train`)
    train       what `baton train` needs (`TrainRecipe`), or None: the family is not trained
    weights     how the checkpoint names its tensors (`Weights`)
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from baton.errors import ConfigError


@dataclass(frozen=True)
class Weights:
    """How a family's checkpoints name their tensors."""

    embeddings: str
    """The embedding table's name in the model (a tied LM head reads it)."""
    prefix_aliases: dict[str, str] = field(default_factory=dict)
    """Checkpoint name prefix -> the model's (first match wins)."""
    fp32_suffixes: tuple[str, ...] = ()
    """Tiny per-head parameters kept float32 in any model dtype."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Checkpoint prefix -> what it is: tensors Baton does not serve, named once in the log."""
    splits: dict[str, str] = field(default_factory=dict)
    """Checkpoint name suffix -> `module:function` (config, name, tensor) -> {name: tensor}:
    one checkpoint tensor that is several of the model's (Qwen3-Next's fused projections)."""


@dataclass(frozen=True)
class TrainRecipe:
    """What `baton train` needs of a family (baton/train): data, torch-free, except the MTP
    head, named by string."""

    sizes: dict[str, dict]
    """Size name -> config.json fields over the family's `tiny` preset (`tiny` for tests)."""
    mtp_head: str
    """`module:function` (transformers' causal LM, config.json dict) -> the trainable MTP head
    (an nn.Module whose parameters carry the published names under `mtp.`; forward(hidden,
    next_ids, embed) -> the head's final-normed hiddens)."""
    planned: tuple[str, int]
    """(size, steps) of the shipped model (docs/training.md)."""
    shipped: str
    """The trained named model (`--model NAME`) the planned run ships as."""
    fields: dict = field(default_factory=dict)
    """config.json fields every size adds (positions, rotary, tied embeddings)."""
    published_prefixes: dict[str, str] = field(default_factory=dict)
    """transformers' in-memory name prefix -> the published checkpoint's (first match)."""


@dataclass(frozen=True)
class FamilySpec:
    name: str
    """The family (a config's `family`; `baton make-model --family`)."""
    model_types: tuple[str, ...]
    """`config.json` `model_type` values this family reads (the name and its aliases)."""
    config: str
    model: str
    stage: str
    weights: Weights
    make: str
    tp: str | None = None
    mtp: str | None = None
    named: dict[str, tuple[str, dict]] = field(default_factory=dict)
    """Named test models (`--model NAME`): name -> (cache folder, `write_checkpoint` kwargs).
    Bump the folder's version when the recipe changes so stale caches are never reused."""
    chat_template: str | None = None
    """`module:attribute` of the family's own chat template (tool calls included), or None."""
    train: TrainRecipe | None = None
    """What `baton train` needs; None: the family is not trained."""
    moe_experts_field: str = "num_experts"
    """The config.json field `baton make-model --moe-experts` sets."""
    default: bool = False
    """The family of a config.json without `model_type` (at most one)."""

    def config_class(self):
        return load(self.config)

    def model_class(self):
        return load(self.model)

    def stage_class(self):
        return load(self.stage)

    def tp_module(self):
        if self.tp is None:
            raise ConfigError(f"family {self.name!r} has no tensor-parallel build yet "
                              f"(families with one: {[s.name for s in specs() if s.tp]})")
        return importlib.import_module(self.tp)

    def mtp_head(self, cfg):
        """The MTP head `cfg` declares (on the current device), or None."""
        return None if self.mtp is None else load(self.mtp)(cfg)

    def chat_template_text(self) -> str:
        if self.chat_template is None:
            raise ConfigError(f"family {self.name!r} declares no chat template (families "
                              f"with one: {[s.name for s in specs() if s.chat_template]})")
        return load(self.chat_template)

    def write_checkpoint(self, out_dir, **kw) -> Path:
        return load(self.make)(out_dir, **kw)


_BY_NAME: dict[str, FamilySpec] = {}
_BY_TYPE: dict[str, FamilySpec] = {}
_discovered = False
_lock = threading.RLock()


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (idempotent for the same spec); a model_type two families claim is an
    error naming both."""
    for kind in spec.model_types:
        other = _BY_TYPE.get(kind)
        if other is not None and other != spec:
            raise ConfigError(f"model_type {kind!r} is claimed by families {other.name!r} "
                              f"and {spec.name!r}")
    _BY_NAME[spec.name] = spec
    _BY_TYPE.update({kind: spec for kind in spec.model_types})
    return spec


def specs() -> list[FamilySpec]:
    _discover()
    return sorted(_BY_NAME.values(), key=lambda s: s.name)


def names() -> list[str]:
    return [s.name for s in specs()]


def trained() -> dict[str, TrainRecipe]:
    """family -> its `TrainRecipe`: the families `baton train` trains."""
    return {s.name: s.train for s in specs() if s.train is not None}


def for_model_type(kind: str | None) -> FamilySpec:
    """The family reading a config.json of `model_type` `kind` (None: the default family)."""
    _discover()
    if not kind:
        return next(s for s in _BY_NAME.values() if s.default)
    spec = _BY_TYPE.get(kind)
    if spec is None:
        raise ConfigError(f"model_type {kind!r} is not served by Baton; served families: "
                          f"{sorted(_BY_TYPE)}")
    return spec


def of(cfg) -> FamilySpec:
    """The family of a loaded config (its `family`)."""
    return by_name(cfg.family)


def by_name(name: str) -> FamilySpec:
    _discover()
    spec = _BY_NAME.get(name)
    if spec is None:
        raise ConfigError(f"family {name!r} is not registered; families: {sorted(_BY_NAME)}")
    return spec


def load(ref: str):
    """`module:attribute` -> the attribute (the module imported on first use)."""
    mod, _, name = ref.partition(":")
    return getattr(importlib.import_module(mod), name)


def _discover() -> None:
    """Import every `baton.model.<family>.family` and the modules `BATON_FAMILY_MODULES`
    names, once."""
    global _discovered
    if _discovered:
        return
    with _lock:  # a second thread waits for the first's imports (re-entrant: they register)
        if _discovered:
            return
        from baton import envs

        here = Path(__file__).parent
        for info in pkgutil.iter_modules([str(here)]):
            if info.ispkg and (here / info.name / "family.py").is_file():
                importlib.import_module(f"{__package__}.{info.name}.family")
        for mod in envs.FAMILY_MODULES.get():
            importlib.import_module(mod)
        _discovered = True
