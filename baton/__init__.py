"""Baton: disaggregated prefill/decode serving for hybrid Mamba + attention models."""

__version__ = "0.1.0"
