"""Hybrid causal LMs (attention + recurrent layers) in plain PyTorch over Baton's paged cache
pools: the family registry (`family`), the engine's contract (`protocol`), the shared model
base (`hybrid`), shared layers (`layers/`) and one folder per family (docs/models.md).

Import what you need from its module (`baton.model.loader`, `baton.model.pools`, ...): the
package itself imports nothing, so a light user (the router's tokenizer) does not load torch.
"""
