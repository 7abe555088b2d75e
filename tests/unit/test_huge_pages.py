"""Every Baton process asks torch for transparent huge pages before torch's first allocation
(baton/__init__.py): the variable is set by importing the package alone, an explicit 0 is
kept, and where the kernel's THP mode allows it a large tensor gets huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, check=True,
                          capture_output=True, text=True, timeout=120).stdout.strip()


@pytest.mark.parametrize("package", ["baton", "bench"])
def test_importing_the_package_sets_huge_pages_before_torch(package):
    out = _run(f"import sys, os, {package}; "
               "print(os.environ['THP_MEM_ALLOC_ENABLE'], 'torch' in sys.modules)")
    assert out == "1 False"


def test_an_explicit_setting_is_kept():
    assert _run("import os, baton; print(os.environ['THP_MEM_ALLOC_ENABLE'])",
                THP_MEM_ALLOC_ENABLE="0") == "0"


def test_a_large_tensor_gets_huge_pages_where_the_kernel_allows():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off in this kernel")
    out = _run("import baton, torch\n"
               "x = torch.ones(16 << 20)\n"  # 64 MiB, touched
               "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup')\n"
               "       if l.startswith('AnonHugePages')][0])")
    # kB: some of it in 2 MB pages (without the variable: none; how many the kernel finds
    # depends on its free memory's fragmentation)
    assert int(out) >= 2048
