"""Process tuning every Baton process does first: importing this module applies it (once; an
entry point's first import: `baton.cli`, the stage and rank launchers run with `python -m`,
`bench`, the test suite's conftest). `import baton` alone changes nothing in the process.

    THP_MEM_ALLOC_ENABLE=1        torch's large CPU allocations on transparent huge pages
    GRPC_ENABLE_FORK_SUPPORT=false  gRPC's fork handlers off, before grpc is imported
    mallopt                       glibc keeps a prefill's freed temporaries on its heap
"""

import ctypes
import os
import sys

from baton import envs

# Transparent huge pages for torch's CPU allocations of 2 MB and more (weights, recurrent-state
# and KV pools): a decode step streams all of them, and with 4 KB pages its TLB misses cost
# ~15% of a batch-32 step on this CPU (the 100m NemotronH: 105-115 -> 90-92 ms a step; the
# Mamba2 state update 17 -> 14.5 ms). torch reads the variable once, at its first allocation,
# so it is set here, before torch is imported; every Baton entry point imports this module
# first. An explicit THP_MEM_ALLOC_ENABLE=0 is kept. Where the kernel's THP mode is `never` it changes nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# gRPC's fork handlers off (grpcio 1.80 and later, grpc/grpc#43055): a child forked (a Popen with
# `preexec_fn`) while a channel is busy restarts gRPC's poller thread in the child, which then
# dies on the epoll fd that Popen's `close_fds` just closed, before the child reaches exec: its
# log holds one `epoll_wait error: Bad file descriptor` line and the program never started (a
# CI run lost a multi-host worker so; 2-3% of such children with grpcio 1.85). Every child a Baton
# process starts execs a new program, which needs none of the parent's gRPC state.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

MMAP_THRESHOLD = 32 << 20
"""glibc's malloc serves allocations below this from its heap (32 MiB: the most it allows)."""
TRIM_THRESHOLD = 256 << 20
"""Free heap memory glibc keeps instead of returning it to the kernel."""


def _keep_freed_memory() -> bool:
    """A prefill's temporaries (a 2,048-token chunk's in_proj output, the scan's chunk
    matrices: 10-30 MB each, dozens a layer) are freed and allocated again every layer. Above
    glibc's dynamic mmap threshold each one was a fresh mmap, every page faulted in (and zeroed)
    on first touch and unmapped at free: 4% of a 100m NemotronH prefill (2.84 -> 2.73 CPU s,
    page faults 246k -> 82k, same peak RSS). Kept on the heap they are reused as they are. glibc only; False elsewhere."""
    if not sys.platform.startswith("linux") or not envs.MALLOC_TUNE.get():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, TRIM_THRESHOLD))


MALLOC_TUNED = _keep_freed_memory()
"""Whether glibc's malloc keeps a prefill's freed temporaries (`BATON_MALLOC_TUNE=0`: off)."""
