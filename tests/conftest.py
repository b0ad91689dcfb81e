"""Shared test setup: device markers skip only where the device is absent; fresh seeds per test."""

from __future__ import annotations

import pytest
import torch


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
