"""Baton's benchmarks (`baton bench ...`, `python -m bench.<name>`)."""

import baton  # noqa: F401 - first: its import sets torch's huge-page allocation (see there)
