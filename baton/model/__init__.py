"""NemotronH (hybrid Mamba2 + attention) in plain PyTorch over Baton's paged cache pools.

Import what you need from its module (`baton.model.loader`, `baton.model.pools`, ...): the
package itself imports nothing, so a light user (the router's tokenizer) does not load torch.
"""
