"""Installing a Debian package a test needs (Slurm, Redis) on a fresh CI machine (root)."""

from __future__ import annotations

import os
import subprocess


def apt_install(packages: list[str]) -> subprocess.CompletedProcess:
    """`apt-get install` of `packages`, once more after `apt-get update` when the lists were
    stale or missing; the last attempt's result (returncode 0: installed)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(install, env=env, capture_output=True, text=True)
    return r
