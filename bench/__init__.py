"""Baton's benchmarks (`baton bench ...`, `python -m bench.<name>`)."""

import baton.startup  # noqa: F401 - first: the process tuning (huge pages before torch)
