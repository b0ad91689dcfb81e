"""Shared test setup: a thread share per worker, device markers that skip only where the device is absent, fresh
seeds per test."""

from __future__ import annotations

import gc
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


# pytest-xdist's loadfile scheduling, with two changes (``--dist loadfile``, pyproject.toml's addopts). xdist hands out
# files in order of their number of tests, so a long file of few tests (the medium model's) started last and ran on
# alone; these start first, longest first (each some 10-60 s of a 2-core run; the rest take a few seconds apiece).
# And the files that compile with inductor run on one worker, which pays inductor's first use (about 4 s) once.
HEAVY_FIRST = (
    "tests/integration/test_compile_modes.py",  # with the other INDUCTOR files
    "tests/integration/test_medium_size.py",
    "tests/integration/test_compat.py",
    "tests/ops/test_affine_metal_emulated.py",
    "tests/recipes/test_linear_attention.py",
    "tests/recipes/fp8/test_fp8_checkpoints.py",
    "tests/core/test_packaging.py",
    "tests/core/test_reliability.py",
    "tests/ops/test_fp8_metal_emulated.py",
    "tests/recipes/fp8/test_fp8_qwen36.py",
    "tests/integration/test_examples.py",
)
INDUCTOR = (
    "tests/integration/test_compile_modes.py",
    "tests/recipes/moe/test_moe_modes.py",
    "tests/quant/test_low_bit_choice.py",  # the int4pack forward
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STALE = [f for f in (*HEAVY_FIRST, *INDUCTOR) if not os.path.isfile(os.path.join(_ROOT, f))]
if _STALE:
    raise pytest.UsageError(f"tests/conftest.py names test files that are not there: {_STALE}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return INDUCTOR[0] if scope in INDUCTOR else scope

        def _assign_work_unit(self, node) -> None:
            for scope in reversed(HEAVY_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return HeavyFirst(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """In a pytest-xdist worker, once every test has run: the heap goes to gc's permanent generation. pytest's closing
    gc.collect() passes and the interpreter's teardown then skip it, and a worker's exit counts in the run's time
    (after tests/integration/test_compat.py alone: 3.2 -> 0.7 s). What it skips is that last collection of cycles
    left by a worker's final tests; the per-test collections and checks are unchanged. Not in a single process
    (``-n0``), whose exit is after the summary, and where MLX's bindings would print the objects left at exit."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.freeze()


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
