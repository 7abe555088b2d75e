"""Which backend and device a TP rank gets: gloo over host memory on CPU, NCCL in device memory
for CUDA ranks (one GPU a rank). Only the CPU side runs here (no GPU on these machines)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from baton.model.layers.parallel import TPGroup, collective_backend, rank_device


def test_cpu_ranks_use_gloo_and_cuda_ranks_nccl_where_torch_has_it(monkeypatch):
    assert collective_backend("cpu") == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert collective_backend("cuda") == collective_backend("cuda:1") == "nccl"
    assert collective_backend("cpu") == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert collective_backend("cuda") == "gloo"


def test_cuda_ranks_take_one_gpu_each_from_the_configured_one(monkeypatch):
    assert [rank_device("cpu", r) for r in range(3)] == ["cpu"] * 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [rank_device("cuda", r) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert [rank_device("cuda:2", r) for r in range(4)] == ["cuda:2", "cuda:3", "cuda:0",
                                                            "cuda:1"]


def test_a_group_stages_through_the_host_only_on_gloo():
    assert not TPGroup(0, 2).on_device
    assert TPGroup(0, 2, backend="nccl").on_device
    t = torch.ones(3)
    assert TPGroup(0, 1).all_reduce(t) is t  # size 1: no communication
