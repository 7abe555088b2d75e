"""NemotronH (hybrid Mamba2 + attention) in plain PyTorch over Baton's paged cache pools.

Exports resolve lazily: `baton.cache.pools` imports `baton.model.config`, and eager imports
here would make that a circular import.
"""

from importlib import import_module

_EXPORTS = {
    "ModelConfig": "baton.model.config",
    "NemotronHModel": "baton.model.nemotron_h",
    "load_model": "baton.model.loader",
    "write_checkpoint": "baton.model.make_model",
    "resolve_model": "baton.model.registry",
    "load_tokenizer": "baton.model.tokenizer",
    "Tokenizer": "baton.model.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'baton.model' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
