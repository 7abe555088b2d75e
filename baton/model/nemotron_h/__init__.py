"""NemotronH: Mamba2 (`M`), attention (`*`), MLP (`-`), MoE (`E`) layers, one mixer per layer.

`config` is importable alone (no torch); the model classes load on first use.
"""

__all__ = ["Block", "NemotronHModel"]


def __getattr__(name: str):
    if name in __all__:
        from baton.model.nemotron_h import model

        return getattr(model, name)
    raise AttributeError(name)
