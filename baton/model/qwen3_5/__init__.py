"""Qwen3.5 dense: gated DeltaNet (`G`) and gated full attention (`*`) layers, each followed by a
SwiGLU MLP.

`config` is importable alone (no torch); the model classes load on first use.
"""

__all__ = ["Qwen35Model", "Qwen35Stage"]


def __getattr__(name: str):
    if name == "Qwen35Model":
        from baton.model.qwen3_5.model import Qwen35Model

        return Qwen35Model
    if name == "Qwen35Stage":
        from baton.model.qwen3_5.stage import Qwen35Stage

        return Qwen35Stage
    raise AttributeError(name)
