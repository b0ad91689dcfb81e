"""The memory probe: peaks at least as large as what the block allocated; counters a device lacks are None."""

from __future__ import annotations

import mmap
import time

import pytest
import torch

from mpsboost.bench import MemoryProbeError, measure_memory
from mpsboost.bench.memory import process_rss_bytes

MiB = 1 << 20


def _fresh_tensor(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A byte tensor of ``size`` on anonymous pages mapped here, every page written: resident memory new to the
    process. (``torch.ones`` of the same size may be served from memory glibc's heap kept resident after a worker's
    earlier tests freed theirs, and then no resident set grows for any probe to see.)"""
    mm = mmap.mmap(-1, size)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(1)
    return mm, t


def test_cpu_rss_peak_covers_a_tensor_allocated_in_the_block():
    size = 96 * MiB
    with measure_memory("cpu") as probe:
        mm, t = _fresh_tensor(size)
    mem = probe.peaks()
    assert t.numel() == size
    assert mem.tensor_allocated is None and mem.allocator_reserved is None  # no such counters on CPU
    assert mem.driver_level_source == "process_rss"
    assert mem.driver_level_at_start is not None and mem.samples >= 2
    assert mem.driver_level - mem.driver_level_at_start >= 0.9 * size


def test_cpu_sampler_catches_a_peak_freed_before_the_block_ends():
    size = 128 * MiB
    with measure_memory("cpu", interval_s=0.001) as probe:
        mm, t = _fresh_tensor(size)
        time.sleep(0.1)  # the background sampler sees it while alive
        del t
        mm.close()  # the pages go back to the system
        time.sleep(0.02)
    mem = probe.peaks()
    assert mem.driver_level - mem.driver_level_at_start >= 0.9 * size
    assert mem.samples > 10
    now = process_rss_bytes()
    assert now is not None and now < mem.driver_level  # the peak is a peak, not the current RSS


def test_probe_misuse_is_reported():
    probe = measure_memory("cpu")
    with pytest.raises(MemoryProbeError, match="before the `with measure_memory"):
        probe.peaks()
    with pytest.raises(MemoryProbeError, match=r"interval_s must be .* got 0"):
        measure_memory("cpu", interval_s=0)
    with pytest.raises(MemoryProbeError, match="not a torch device"):
        measure_memory("gpu7")
    with pytest.raises(MemoryProbeError, match="has no memory probe"):
        measure_memory("meta")


def test_missing_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(MemoryProbeError, match="sees no CUDA device"):
        measure_memory("cuda")
    with pytest.raises(MemoryProbeError, match="sees no MPS device"):
        measure_memory("mps")


def test_exceptions_in_the_block_propagate_and_leave_peaks_readable():
    with pytest.raises(ZeroDivisionError):
        with measure_memory("cpu") as probe:
            1 / 0
    assert probe.peaks().driver_level is not None


@pytest.mark.cuda
def test_cuda_peaks_split_three_ways():
    size = 256 * MiB
    with measure_memory("cuda") as probe:
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        t.fill_(1)
    mem = probe.peaks()
    assert mem.tensor_allocated - mem.tensor_allocated_at_start >= size
    assert mem.allocator_reserved >= mem.tensor_allocated
    assert mem.driver_level_source in ("nvml_device_used", "cuda_mem_get_info")
    assert mem.driver_level >= mem.allocator_reserved  # the driver sees at least what the allocator holds
    del t


@pytest.mark.mps
def test_mps_peaks_tensor_and_driver():
    size = 256 * MiB
    with measure_memory("mps") as probe:
        t = torch.ones(size // 4, device="mps")
        torch.mps.synchronize()
    mem = probe.peaks()
    assert mem.allocator_reserved is None  # MPS has no public allocator-reserved counter
    assert mem.tensor_allocated - mem.tensor_allocated_at_start >= size
    assert mem.driver_level >= mem.tensor_allocated
    del t
