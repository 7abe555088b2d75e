"""How every Baton process sets up its memory first (baton/startup.py, which every entry point
imports first; `import baton` alone changes nothing): torch's
transparent huge pages asked for before torch's first allocation (an explicit 0 kept; where
the kernel's THP mode allows it a large tensor gets huge pages), and glibc's malloc keeping
freed 10-30 MB temporaries on its heap, so allocating one again faults no pages."""

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


@pytest.mark.parametrize("package", ["baton.startup", "bench", "baton.cli"])
def test_importing_the_package_sets_huge_pages_before_torch(package):
    out = _run(f"import sys, os, {package}; "
               "print(os.environ['THP_MEM_ALLOC_ENABLE'], 'torch' in sys.modules)")
    assert out == "1 False"


def test_importing_baton_alone_changes_nothing_in_the_process():
    env = {k: v for k, v in os.environ.items()
           if k not in ("THP_MEM_ALLOC_ENABLE", "GRPC_ENABLE_FORK_SUPPORT")}
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys, baton, baton.model.config; print("
         "os.environ.get('THP_MEM_ALLOC_ENABLE'), os.environ.get('GRPC_ENABLE_FORK_SUPPORT'), "
         "'baton.startup' in sys.modules)"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["None", "None", "False"]


def test_an_explicit_setting_is_kept():
    assert _run("import os, baton.startup; print(os.environ['THP_MEM_ALLOC_ENABLE'])",
                THP_MEM_ALLOC_ENABLE="0") == "0"


def test_a_large_tensor_gets_huge_pages_where_the_kernel_allows():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off in this kernel")
    out = _run("import baton.startup, torch\n"
               "x = torch.ones(16 << 20)\n"  # 64 MiB, touched
               "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup')\n"
               "       if l.startswith('AnonHugePages')][0])")
    # kB: some of it in 2 MB pages (without the variable: none; how many the kernel finds
    # depends on its free memory's fragmentation)
    assert int(out) >= 2048


_HEAP = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
info = ctypes.CDLL(None).mallinfo2
info.restype = Info
mib = 1 << 20
t = torch.empty(24 << 18).fill_(1.0)  # 24 MiB, a prefill layer's temporary
mapped = info().hblkhd // mib  # MiB in blocks of their own mmap
del t
print(mapped, info().fordblks // mib)  # and MiB kept free on the heap once it is freed
"""


def test_freed_temporaries_stay_on_the_heap():
    """A 24 MiB tensor comes from glibc's heap and its memory stays there once freed (the next
    one reuses it: no page faults, no zeroing); with BATON_MALLOC_TUNE=0 it is an mmap of its
    own, unmapped at free (and faulted in afresh by the next)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc only")
    try:
        import ctypes
        ctypes.CDLL(None).mallinfo2  # noqa: B018 - glibc >= 2.33
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2 here")
    assert _run("import baton.startup; print(baton.startup.MALLOC_TUNED)") == "True"
    mapped, kept = map(int, _run("import baton.startup\n" + _HEAP).split())
    assert mapped < 24 and kept >= 24
    mapped, kept = map(int, _run("import baton.startup\n" + _HEAP,
                                 BATON_MALLOC_TUNE="0").split())
    assert mapped >= 24 and kept < 24
