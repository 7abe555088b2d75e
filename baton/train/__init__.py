"""`baton train`: small models trained here on the Python standard library (outside the serving path)."""
