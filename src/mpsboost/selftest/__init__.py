"""``mpsboost selftest``: evidence from this machine, in one command, in a file to send to the project.

1. It refuses a device that is absent (exit 2, one line, no file).
2. Bug probes (:mod:`.probes`): each known upstream MPS bug at its trigger size, stock torch against
   a CPU reference, each naming its pytorch issue or pull request and the gate feature it confirms or
   refutes: "has the bug", "fixed", "not applicable" (not on MPS), "skipped" (memory, budget) or "error".
3. Seed workloads (:mod:`.workloads`): the Wan2.2 VAE tiled decode with the three memory counters,
   the Qwen-Image and Qwen-Image-2.1 round trips with PSNR against the CPU, a few Qwen3.6 layers
   decoding (Gated DeltaNet + MoE) and an fp8 layer, stock against ``mpsboost.patch()`` in one
   process, then timed again in fresh processes (MPS picks a slower GEMM kernel in about 40% of
   fresh processes, pytorch#182815): each speed ratio comes with its spread.
4. Recipe checks (:mod:`.recipes`): every recipe on a tiny model, patched against stock and the CPU.
5. Machine facts (:mod:`.machine`): chip, macOS, memory, torch build, Python, library versions; no
   user name, host name or path.
6. The files (:mod:`.report`): ``mpsboost-selftest-<device>-<torch>.jsonl`` and a markdown report to
   paste into an issue, which says what the file holds, that it holds no personal data and where to
   send it. ``--validate`` checks a file; ``benchmarks/mac_results.py`` turns contributed files into
   the published table.

Sizes: ``--quick`` (default; stops at its 480 s budget, checked before each step of a workload),
``--full`` (upstream sizes, 1800 s), ``--size test`` (tiny models: ``--size test`` took 110 s on a busy
2-core Linux CPU). No run on a Mac has been timed yet. On the CPU the workloads always run at the test
size, in one process, within 200 s (the default run took 159 s there).
"""

from __future__ import annotations

from .probes import PROBES, VERDICTS, Probe, decisions
from .recipe_checks import (
    LOSSY,
    STATUSES,
    TOLERANCE,
    WORKLOADS,
    RecipeResult,
    RecipeWorkload,
    format_table,
)
from .report import (
    SCHEMA,
    SelftestFormatError,
    issue_tracker,
    markdown,
    read_lines,
    revisit,
    validate,
)
from .run import (
    BUDGET_S,
    PROCESSES,
    DeviceAbsentError,
    build_parser,
    main,
    run_selftest,
)
from .workloads import SEED_WORKLOADS, SIZES, SeedWorkload

__all__ = [
    "BUDGET_S",
    "LOSSY",
    "PROBES",
    "PROCESSES",
    "SCHEMA",
    "SEED_WORKLOADS",
    "SIZES",
    "STATUSES",
    "TOLERANCE",
    "VERDICTS",
    "WORKLOADS",
    "DeviceAbsentError",
    "Probe",
    "RecipeResult",
    "SeedWorkload",
    "SelftestFormatError",
    "RecipeWorkload",
    "build_parser",
    "decisions",
    "format_table",
    "issue_tracker",
    "main",
    "markdown",
    "read_lines",
    "revisit",
    "run_selftest",
    "validate",
]
