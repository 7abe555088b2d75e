"""Baton: disaggregated prefill/decode serving for hybrid Mamba + attention models."""

import os

__version__ = "0.1.0"

# Transparent huge pages for torch's CPU allocations of 2 MB and more (weights, recurrent-state
# and KV pools): a decode step streams all of them, and with 4 KB pages its TLB misses cost
# ~15% of a batch-32 step on this CPU (the 100m NemotronH: 105-115 -> 90-92 ms a step; the
# Mamba2 state update 17 -> 14.5 ms). torch reads the variable once, at its first allocation,
# so it is set here, before anything under baton imports torch; every Baton process starts
# as `python -m baton...` (or `bench...`, whose package imports this first). An explicit
# THP_MEM_ALLOC_ENABLE=0 is kept. Where the kernel's THP mode is `never` it changes nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
