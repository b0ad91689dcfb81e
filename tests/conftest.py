"""Shared test setup: a thread share per worker, device markers that skip only where the device is absent, fresh
seeds per test."""

from __future__ import annotations

import os

import pytest
import torch

# One intra-op thread pool per core, not per worker. pytest-xdist starts a worker per core and torch gives
# each worker a thread per core: on 2 cores, 2 workers x 2 threads spin-wait for each other, and the same
# tests took 13.6x the time (tests/recipes/test_linear_attention.py with test_moe_block.py, -n 2: 362.9 s
# at 2 threads a worker, 26.6 s at 1). The environment variable carries the same share to the scripts
# and fresh interpreters the tests start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_THREADS = max(1, _CORES // _WORKERS)
torch.set_num_threads(_THREADS)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)
# Inductor's CPU code without SIMD intrinsics: each generated C++ file compiles in about 1 s instead of 1.5 (a few
# dozen per model). What the tests check of inductor is its lowering of mpsboost's operators and graphs; on a Mac it
# writes Metal, not this C++. Read when inductor's config is first imported (the first compile).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_mps = torch.backends.mps.is_available()
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none present"))
        if "mps" in item.keywords and not has_mps:
            item.add_marker(pytest.mark.skip(reason="needs an Apple MPS device; none present"))


@pytest.fixture
def rng_seed(request) -> int:
    """A fresh seed per test, printed on failure, so inputs differ between tests and runs."""
    import random

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.fixture(scope="session")
def medium():
    """The medium model and its decode-step costs, once per worker (tests/step_costs.py)."""
    from step_costs import MediumModel

    return MediumModel()
