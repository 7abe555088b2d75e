"""CPU tensors on transparent huge pages, all of them.

Decode streams every weight once a step, and a batch-32 step reads and writes every state slot
of the batch: hundreds of MB through 4 KiB pages is a TLB miss every 4 KiB. Where the kernel
gives huge pages only to memory that asks for them (`transparent_hugepage/enabled` =
`madvise`, the usual default), torch asks for allocations of 2 MB and more
(THP_MEM_ALLOC_ENABLE, set in baton/startup.py), each on its own: a tensor's tail past its
last whole 2 MB, and every smaller weight (a 100m Qwen3.5-MoE's shared experts and DeltaNet
out_proj, 1.5-2 MB each: 133 of its 1,021 MB), stay on 4 KiB pages, and a weight stream
crosses between them. `place_on_huge_pages` packs a model's weights into one arena advised
`MADV_HUGEPAGE`; `huge_zeros` allocates a pool there. The same bytes at the same strides, so
every result is unchanged (measured figures in docs/performance.md). Where huge pages are
not offered (another OS, `never`) these do nothing and say so once.
"""

from __future__ import annotations

import functools
import logging
import mmap
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("baton.model")

HUGE = 2 << 20
"""The x86-64 huge page: mappings are aligned to it so every full 2 MiB can be one."""
MIN_BYTES = 1 << 20
"""Storages smaller than this stay where they are (norm weights, biases: no stream to gain)."""
ALIGN = 4096
"""Each storage starts on its own page in the arena."""


@functools.cache
def available() -> bool:
    """Whether this machine gives huge pages to a mapping that asks for them (read once)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _arena(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory (uint8) in an anonymous mapping advised MADV_HUGEPAGE, starting
    on a 2 MiB boundary. The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:  # a kernel without THP support: plain pages, the same memory
        log.info("madvise(MADV_HUGEPAGE) refused (%s): 4 KiB pages", e)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes]


def huge_zeros(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`, on huge pages where it is a CPU
    tensor of at least MIN_BYTES and the machine offers them."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    # written now, as torch.zeros writes its zeros: the memory is committed at start (an
    # engine that cannot have its pools fails there, not under load)
    return _arena(nbytes).view(dtype).view(shape).zero_()


BEFORE_MOVE: list = []
"""Called with the model before its weights move: who caches views of them drops them
(`baton.model.layers.linear` registers itself on import; nothing to drop without it)."""


def place_on_huge_pages(model: nn.Module) -> int:
    """Move every CPU parameter and buffer whose storage holds at least MIN_BYTES into one
    arena on huge pages (`_arena`), in place: each Parameter object keeps its identity (tied
    weights stay tied), tensors that share a storage share its copy at the same offsets and
    strides. Storage by storage, so each old one is freed as soon as it is copied (the peak is
    the model plus its largest storage, where nothing else holds the old ones). The fast
    path's caches of weight views are dropped first and its plans rebuilt
    (`linear._state["generation"]`). Returns the bytes moved: 0 where huge pages are not
    offered."""
    if not available():
        log.info("weights stay on 4 KiB pages: this machine offers no transparent huge pages")
        return 0
    for drop in BEFORE_MOVE:  # views of the old storages (the fast path's caches)
        drop(model)
    # (module, name, is a parameter) by storage, and each storage's offset in the arena
    groups: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    sizes: dict[int, int] = {}
    for m in model.modules():
        for table, param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is None or t.device.type != "cpu":
                    continue
                s = t.untyped_storage()
                if s.nbytes() >= MIN_BYTES:
                    groups.setdefault(s.data_ptr(), []).append((m, name, param))
                    sizes[s.data_ptr()] = s.nbytes()
    if not groups:
        return 0
    offsets, total = {}, 0
    for ptr, n in sizes.items():
        offsets[ptr] = total
        total += -(-n // ALIGN) * ALIGN
    arena = _arena(total)
    base = arena.untyped_storage()
    first = arena.data_ptr() - base.data_ptr()  # the arena's start within its mapping
    with torch.no_grad():
        for ptr in list(groups):
            slots = groups.pop(ptr)
            made: dict[tuple, torch.Tensor] = {}  # a view of this storage: its copy
            for m, name, param in slots:
                t = (m._parameters if param else m._buffers)[name]
                if t.untyped_storage().data_ptr() != ptr:
                    continue  # a Parameter two modules hold, moved already
                if not made:
                    src = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                    arena[offsets[ptr]:offsets[ptr] + sizes[ptr]].copy_(src)
                    del src
                key = (t.dtype, t.storage_offset(), tuple(t.size()), t.stride())
                if key not in made:
                    size = t.element_size()
                    at = first + offsets[ptr] + t.storage_offset() * size
                    made[key] = torch.empty(0, dtype=t.dtype).set_(base, at // size, t.size(),
                                                                   t.stride())
                if param:
                    t.data = made[key]
                else:
                    m._buffers[name] = made[key]
            del t, slots, made
    _give_back_freed()
    return total


def _give_back_freed() -> None:
    """Return the old storages' memory to the OS: glibc's malloc keeps freed chunks of its
    heap (allocations under its dynamic mmap threshold, up to 32 MB each), and without this a
    1 GB model's process kept ~2 GB resident after the move."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: its allocator decides
        pass
