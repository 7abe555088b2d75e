"""Baton's benchmarks (`baton bench ...`, `python -m bench.<name>`)."""

import baton.startup  # noqa: F401 - first: the process tuning (huge pages before torch)

BENCHES = ("engine", "reuse", "transfer", "router", "e2e", "handoff", "pp", "tp", "http",
           "soak", "spec", "quality", "grammar", "precision")
"""What `baton bench NAME` runs (`all`: each in this order), each `bench/NAME.py`'s `run(args)`:
the one list, which the CLI's choices read too."""
