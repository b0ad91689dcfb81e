"""The Metal emulation itself (``tests/ops/metal_emu``, built by ``tests/metal_emulation.py``): what the kernels'
tests rely on it to catch. Its threads are fibers of one OS thread, resumed in ascending order in even threadgroups
and descending order in odd ones, so a read of another thread's threadgroup memory with no barrier before it reads a
stale value whichever side of it the writer is; a simd_sum some lane of its simdgroup skips is a deadlock the driver
reports (exit 2), not a hang."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import metal_emulation
import pytest

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Every thread writes its own value to threadgroup memory and reads its neighbour's (step +1: the one above, -1: the
// one below; the last one its own), after a barrier or not.
kernel void mpsb_emu_neighbour(device float* out [[buffer(0)]],
                               constant long& with_barrier [[buffer(1)]],
                               constant long& step [[buffer(2)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float buf[64];
  const long tid = long(sg) * 32 + long(lane);
  buf[tid] = float(1000 * long(tg.x) + tid);
  if (with_barrier != 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const long j = tid + step;
  out[long(tg.x) * 64 + tid] = buf[j >= 0 && j < 64 ? j : tid];
}

// Lane 0 of each simdgroup skips the simd_sum its other lanes reach (divergent simd_sum: undefined in Metal).
kernel void mpsb_emu_divergent(device float* out [[buffer(0)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if (lane != 0) {
    out[long(sg) * 32 + long(lane)] = simd_sum(1.0f);
  }
}
"""
NAMES = ("mpsb_emu_neighbour", "mpsb_emu_divergent")
GROUPS = 2  # threadgroups of 64 threads (two simdgroups): one resumed in ascending order, one in descending


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    return metal_emulation.driver(SOURCE, NAMES, tmp_path_factory, what="the emulation's own test kernels")


def _launch(exe: Path, tmp: Path, name: str, nfloats: int, scalars: tuple[int, ...]) -> subprocess.CompletedProcess:
    """One launch of ``name`` over ``GROUPS`` threadgroups of 64 threads, one float buffer of ``nfloats`` zeros."""
    buf = bytes(4 * nfloats)
    counts = (1, len(scalars), len(buf), *scalars)
    head = b"MPSBEMU2" + name.encode().ljust(64, b"\0")
    head += struct.pack(f"<{4 + len(counts)}q", 64 * GROUPS, 1, 64, 1, *counts)
    (tmp / "in.bin").write_bytes(head + buf)
    return subprocess.run([str(exe), str(tmp / "in.bin"), str(tmp / "out.bin")], capture_output=True, timeout=30)


def _out(tmp: Path) -> list[float]:
    data = (tmp / "out.bin").read_bytes()
    return list(struct.unpack(f"<{len(data) // 4}f", data))


@pytest.mark.parametrize("step", [1, -1], ids=["above", "below"])
def test_a_missing_barrier_reads_a_stale_neighbour_on_either_side(driver, tmp_path, step):
    def neighbour(g, t):
        return float(1000 * g + (t + step if 0 <= t + step < 64 else t))

    want = [neighbour(g, t) for g in range(GROUPS) for t in range(64)]
    proc = _launch(driver, tmp_path, "mpsb_emu_neighbour", 64 * GROUPS, (1, step))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert _out(tmp_path) == want  # with the barrier: every neighbour's own value
    proc = _launch(driver, tmp_path, "mpsb_emu_neighbour", 64 * GROUPS, (0, step))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = _out(tmp_path)
    # without it: the threadgroup whose order runs each reader before its neighbour reads stale values (the one in
    # the other order happens to read them right)
    wrong = [i for i in range(64 * GROUPS) if got[i] != want[i]]
    assert wrong, f"every thread read its neighbour {step:+d} without a barrier: the race went unseen"


def test_a_simd_sum_one_lane_skips_is_reported_as_a_deadlock(driver, tmp_path):
    proc = _launch(driver, tmp_path, "mpsb_emu_divergent", 64, ())
    assert proc.returncode == 2 and b"deadlock" in proc.stderr, (proc.returncode, proc.stderr.decode()[-3000:])
