"""A Metal ``SOURCE`` compiled by g++ against the emulation in ``tests/ops/metal_emu``, once per test run.

``driver(source, names, ...)`` writes ``SOURCE`` as ``kernels.metal`` (included verbatim by ``driver.cpp``) and, for
``names``, the dispatch table ``kernels_table.inc``; it builds with AddressSanitizer and UBSan where they link, else
without. The executable is kept in the test run's shared temporary folder under a hash of everything that goes into
it (the source, the table, the flags, ``driver.cpp`` and ``metal_stdlib``), so the test modules and pytest-xdist
workers that need the same build share one g++ run; a file lock makes the others wait for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

EMU = Path(__file__).parent / "ops" / "metal_emu"
BASE_FLAGS = ["-std=c++20", "-O1", "-pthread", "-Wno-attributes", "-fno-strict-aliasing"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def driver(source: str, names, tmp_path_factory, *, what: str, sanitize: bool = True, table: bool = True) -> Path:
    """The emulation's executable for ``source`` (``what`` names it in a failure). ``table``: write the dispatch
    table for ``names`` (the fp8 kernels' names are built into ``driver.cpp``, which has no table for them)."""
    if shutil.which("g++") is None:
        pytest.skip(f"g++ not found: the emulated Metal kernel test compiles {what} as C++20 with g++")
    inc = "".join(f'if (k == "{n}") {{ dispatch({n}, threads, group, sc, bufs); }} else\n' for n in names)
    flavours = [SANITIZE, []] if sanitize else [[]]
    key = hashlib.sha256()
    for part in (source, inc if table else "", repr((BASE_FLAGS, flavours))):
        key.update(part.encode() + b"\0")
    for f in sorted(EMU.iterdir()):
        key.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    # The base temporary folder of an xdist worker is one of the run's (.../pytest-N/popen-gwK); its parent is the
    # run's own, shared by every worker and by nothing else.
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    build = root / "metal-emu" / key.hexdigest()[:20]
    build.mkdir(parents=True, exist_ok=True)
    exe = build / "driver"
    with open(build / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on a failure
        if exe.is_file():
            return exe
        (build / "kernels.metal").write_text(source)
        if table:
            (build / "kernels_table.inc").write_text(inc)
        partial = build / "driver.partial"
        for extra in flavours:
            cmd = ["g++", *BASE_FLAGS, *extra, "-I", str(EMU), "-I", str(build), str(EMU / "driver.cpp")]
            proc = subprocess.run([*cmd, "-o", str(partial)], capture_output=True, text=True, timeout=600)
            if proc.returncode == 0:
                partial.rename(exe)  # whole or absent: a worker never runs half a link's output
                return exe
        pytest.fail(f"g++ could not compile {what} against the Metal emulation:\n{proc.stderr[-6000:]}")
