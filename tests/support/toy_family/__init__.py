"""A model family that lives only here (the restructure's acceptance test): a dense model of
attention (`*`) and MLP (`-`) blocks, built from NemotronH's layers under its own
`model_type`, `toy_dense`. Registering it is the one entry in `family.py`; Baton's own code
does not change for it. Worker processes find it through `BATON_FAMILY_MODULES`."""
