"""Baton: disaggregated prefill/decode serving for hybrid Mamba + attention models.

Importing the package changes nothing in the process: entry points import `baton.startup`
first (huge pages, gRPC's fork handlers, malloc tuning)."""

__version__ = "0.1.0"
