"""Shared pytest fixtures. Model fixtures are prefixed `model_`."""

from __future__ import annotations

import os

import pytest
import torch

import baton.startup  # noqa: F401 - the process tuning (gRPC's fork handlers) before grpc loads

# Tiny-model ops are dominated by thread hand-off; one thread is faster and steadier on the
# 2-core CI box, and worker processes started by tests inherit it.
os.environ.setdefault("BATON_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["BATON_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Baton's CPU kernels built (first run on a machine: about a minute) before any test, so
    no worker process a test starts compiles them against that test's time limits."""
    from baton.model.layers import cpu_kernels, step_kernels

    return cpu_kernels.gemv(), step_kernels.kernels()


@pytest.fixture(scope="session")
def kernel(cpu_kernels_built):
    """Baton's gemv kernel module (the tests that call it skip where it does not build)."""
    if cpu_kernels_built[0] is None:
        pytest.skip("the C++ kernel does not build here (no compiler?)")
    return cpu_kernels_built[0]


@pytest.fixture(scope="session")
def model_tiny_dir(tmp_path_factory):
    """A seeded tiny NemotronH checkpoint (all three layer kinds), written once per session."""
    from baton.model.make_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("model_tiny"), seed=0)


@pytest.fixture(scope="session")
def model_tiny(model_tiny_dir):
    """The tiny checkpoint loaded in float32 on CPU (read-only: tests must not change weights)."""
    from baton.model.loader import load_model

    return load_model(model_tiny_dir)


@pytest.fixture(scope="module")
def model_single_thread():
    """Run torch on one thread for the module: tiny-model ops are dominated by OpenMP
    hand-off, which gets 10-50x slower when the CI box is oversubscribed."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(session, config, items):
    """Modules that set `RUN_FIRST = True` run before the rest (under `--dist loadfile` their
    file is the first one handed to a worker): test_grpc_fork forks its own process 300 times,
    which costs a few seconds in a fresh worker and a minute in one grown by cluster tests."""
    first = [i for i in items if getattr(i.module, "RUN_FIRST", False)]
    if first:
        items[:] = first + [i for i in items if i not in first]
