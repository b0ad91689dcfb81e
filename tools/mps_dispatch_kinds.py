#!/usr/bin/env python
"""Which aten ops of a decode step run a Metal shader and which an MPSGraph on a Mac, per torch release, read
from the macOS arm64 wheels (``src/mpsboost/data/mps_dispatch_kinds.json``).

Why it matters: on torch's MPS backend a Metal-shader op costs about 1.3 µs of host time to encode, an op that
still builds and runs an MPSGraph about 20 µs (pytorch#148219, M1 Pro). The cost model of
``mpsboost.bench.decode_cost`` needs to know which is which.

The evidence is the wheel a Mac gets from ``pip install torch``, not a source tree whose commit might not be the
release's. In each wheel's ``torch/lib/libtorch_cpu.dylib``:

* **Metal**: the function names of the embedded metallibs (``NAME`` tags, read by
  ``tools/wheel_facts.metal_kernels``). A rule names the op's own kernel family by a regular expression
  (``mul.Tensor``: ``mul_dense_*``, ``mul_strided_*``, ...). A match means the release ships a Metal kernel
  for the op.
* **MPSGraph**: a string literal that is the op's MPSGraph cache key or sits in the function that builds
  its graph (``softmax_mps_out`` in 2.14.1; ``MM/(batch1@batch2)`` for ``bmm``). A match means the
  release still has the MPSGraph path.

A rule's kind in a release is then ``metal`` (only the Metal kernel), ``mpsgraph`` (only the MPSGraph marker),
``mixed`` (both: which one a decode shape takes depends on a branch the binary does not show, such as the matmuls'
GEMV-or-MPSGraph choice, ``PYTORCH_MPS_PREFER_METAL`` / ``use_metal_mm``) or ``unknown`` (neither found). The
cost model prices ``mixed`` and ``unknown`` both ways and reports the range. Every row names its evidence: the
number of matched kernels, a few names, the markers found and the wheel's sha256.

``PYTORCH_BINARY_FORCE_FLAVOR`` / ``PYTORCH_UNARY_FORCE_FLAVOR`` are not a Metal-or-MPSGraph switch: in both
wheels the strings sit in ``exec_binary_kernel`` / the unary kernel launcher beside the format strings of the
Metal variants (``{}_dense_broadcast{}_...``, ``dense_ilp4``, ``strided_castout``). They pick among Metal
kernel variants.

Scope: the ops that the decode steps of the Qwen3.5/3.6-MoE model dispatch, stock and patched by mpsboost
(bf16, fp8, under Mac 2.14.1 and 2.15.0 decisions), not every MPS op: ``RULES`` lists them, and
``tests/bench/test_decode_predict.py`` fails when a decode step dispatches a kernel-launching op with no row.
Ops of the ``mpsboost`` namespace are mpsboost's own Metal kernels (``torch.mps.compile_shader``) and need no
row. One aten op is counted as one dispatch even where its kernel is several passes (``topk``/``sort``'s
multi-block merge, SDPA's two-pass decode kernel, a matmul's split-K): an undercount the table notes per row.

    python tools/mps_dispatch_kinds.py                       # wheels from .wheelcache/ (tools/wheel_facts.py fills it)
    python tools/mps_dispatch_kinds.py --versions 2.15.0 --cache /path/to/wheels
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import wheel_facts  # noqa: E402

OUT = ROOT / "src" / "mpsboost" / "data" / "mps_dispatch_kinds.json"
VERSIONS = ("2.14.1", "2.15.0")
SAMPLES = 4


@dataclass(frozen=True)
class Rule:
    """One op family. ``ops``: the aten overload-packet names it covers (in-place and ``out=`` overloads share
    the kernel: ``add``, ``add_``). ``metal``: regex over the metallib function names (None: no Metal kernel
    expected). ``graph``: exact string literals of the MPSGraph path. ``note``: what the binary leaves open."""

    ops: tuple[str, ...]
    metal: str | None
    graph: tuple[str, ...] = ()
    note: str = ""


_EW = r"_(dense|strided|inner_contiguous)"  # the elementwise kernels' layout variants
RULES: tuple[Rule, ...] = (
    # elementwise: binary, unary, ternary
    Rule(("add", "add_"), rf"^add{_EW}|^add_alpha{_EW}"),
    Rule(("sub", "sub_"), rf"^sub{_EW}|^sub_alpha"),
    Rule(("mul", "mul_"), rf"^mul{_EW}"),
    Rule(("div", "div_"), rf"^div_true{_EW}"),
    Rule(("floor_divide", "floor_divide_"), rf"^div_floor{_EW}"),
    Rule(("pow", "pow_"), rf"^pow{_EW}|^pow_scalar"),
    Rule(("hypot", "hypot_"), rf"^hypot{_EW}"),
    Rule(("exp", "exp_"), rf"^exp{_EW}"),
    Rule(("sigmoid", "sigmoid_"), rf"^sigmoid{_EW}"),
    Rule(("rsqrt", "rsqrt_"), rf"^rsqrt{_EW}"),
    Rule(("sin", "sin_"), rf"^sin{_EW}"),
    Rule(("cos", "cos_"), rf"^cos{_EW}"),
    Rule(("neg", "neg_"), rf"^neg{_EW}|^copy_neg{_EW}"),
    Rule(("silu", "silu_"), rf"^silu{_EW}"),
    Rule(("log_sigmoid_forward",), rf"^log_sigmoid_forward{_EW}|^log_sigmoid_forward_"),
    Rule(("softplus",), rf"^softplus{_EW}", ("softplus_out_mps:",)),
    Rule(("addcmul", "addcmul_"), r"^addcmul_", ("addcmul_out_mps",)),
    # reductions, normalisation, softmax
    Rule(("sum",), r"^sum_reduction"),
    Rule(("mean",), r"^sum_reduction", note="mean_out_mps sits among the Metal reduction formats in both wheels"),
    Rule(("linalg_vector_norm",), r"^norm_l2_(combine_)?reduction|^norm_(float|half|bfloat)_"),
    Rule(
        ("_fused_rms_norm",),
        r"^rms_norm(_looped)?_(float|half|bfloat)$",
        note="what F.rms_norm with a same-dtype weight runs on MPS (rms_norm_symint routes it there); "
        "mpsboost.bench.decode_cost counts it in place of the CPU's composite",
    ),
    Rule(("_softmax",), r"^softmax_(row|partial|finalize|strided_partial|strided_finalize)_", ("softmax_mps_out",)),
    # sorting, selection, scans
    Rule(("topk",), r"_topk(_|$)", note="several passes (block sort, merges) counted as one"),
    Rule(("sort",), r"^(sort_block|mb_sort_block|mb_merge|radix_)", note="several passes counted as one"),
    Rule(("cumsum", "cumsum_"), r"^cumsum_"),
    Rule(("searchsorted",), r"^searchsorted_"),
    Rule(
        ("histc",),
        r"^histc_atomic_|^histogramdd",
        note="torch <= 2.14 histc costs about 0.17 ms per bin on MPS (pytorch#198304): far above one dispatch",
    ),
    # indexing, gathers, copies, factories
    Rule(("gather",), r"^gather_"),
    Rule(("index_select",), r"^index_select_(dim_)?(8|16|32|64)bit"),
    Rule(("index",), r"^index_select_(8|16|32|64)bit"),
    Rule(("index_put", "index_put_"), r"^index_put_"),
    Rule(("embedding",), r"^embedding_"),
    Rule(("cat",), r"^cat_"),
    Rule(("arange",), r"^arange_"),
    Rule(
        ("copy_", "_to_copy", "clone"),
        r"^copy_identity_",
        note="a contiguous same-dtype copy is a blit (copyFromBuffer), priced as a Metal dispatch",
    ),
    Rule(("zeros_like", "zero_", "fill_"), r"^fill_scalar_", note="or a blit fill, priced as a Metal dispatch"),
    # matmuls
    Rule(
        ("mm",),
        r"^gemv_(t|nt|t2d)_",
        ("mm_out_mps_impl", "use_metal_mm"),
        note="mm_out_mps_impl holds dispatch_gemv and the gemv_* kernels beside its MPSGraph matmul; "
        "which shapes take the GEMV is not in the binary",
    ),
    Rule(("addmm",), r"^addmm_", ("MM/beta*input + alpha*(mat1@mat2)",)),
    Rule(("bmm",), r"^naive_bmm_", ("MM/(batch1@batch2)",)),
    Rule(("baddbmm",), r"^naive_baddbmm_", ("addbmm_or_baddbmm_out_mps_impl",)),
    Rule(
        ("_grouped_mm",),
        r"^grouped_mm_",
        note="no MPS kernel before 2.15 (data/mps_ops.json): _grouped_mm_fallback, one mm per group",
    ),
    Rule(
        ("convolution",),
        r"^conv1d_depthwise_",
        ("_mps_convolution_impl",),
        note="2.15 adds depthwise conv1d Metal kernels beside the MPSGraph convolution",
    ),
    # not in a decode step: the selftest's MPSGraph op (probe dispatch_cost times it)
    Rule(("prelu", "_prelu_kernel"), r"prelu", ("prelu_mps:",), note="the selftest's MPSGraph dispatch"),
    # attention: the CPU trace's op stands for the MPS one (_scaled_dot_product_attention_math_for_mps)
    Rule(
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math_for_mps"),
        r"^sdpa_vector",
        note="the CPU trace's op; on MPS the decode query takes sdpa_vector (sdpa_vector_fast_mps), "
        "two passes for long caches, counted as one",
    ),
)


def _kind(metal: bool, graph: bool) -> str:
    return {(True, False): "metal", (False, True): "mpsgraph", (True, True): "mixed"}.get((metal, graph), "unknown")


def classify(kernels: set[str], blob: bytes) -> dict[str, dict]:
    """``{op: row}`` for every op of :data:`RULES` in one wheel: ``kind`` and its evidence."""
    rows = {}
    for rule in RULES:
        hits = sorted(k for k in kernels if rule.metal and re.search(rule.metal, k))
        found = [g for g in rule.graph if b"\x00" + g.encode() + b"\x00" in blob]
        row = {
            "kind": _kind(bool(hits), bool(found)),
            "metal_kernels": len(hits),
            "metal_sample": hits[:SAMPLES],
            "metal_pattern": rule.metal,
            "mpsgraph_markers": found,
        }
        if rule.note:
            row["note"] = rule.note
        for op in rule.ops:
            rows[op] = row
    return rows


def read(version: str, cache: Path) -> dict:
    path = cache / f"torch-{version}-cp312-cp312-{wheel_facts.PLATFORM}.whl"
    if not path.exists():
        raise SystemExit(f"{path} is missing: fetch it with python tools/wheel_facts.py --versions {version}")
    with zipfile.ZipFile(path) as zf:
        blob = zf.read(wheel_facts.DYLIB)
    return {
        "version": version,
        "file": path.name,
        "sha256": wheel_facts._sha256(path),
        "ops": classify(wheel_facts.metal_kernels(blob), blob),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", nargs="+", default=list(VERSIONS))
    p.add_argument("--cache", type=Path, default=wheel_facts.CACHE)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    table = {
        "about": (
            "Per torch release, the kind of kernel each aten op of the Qwen3.5/3.6-MoE decode step (stock and "
            "mpsboost-patched) runs on MPS: 'metal' (a Metal shader only), 'mpsgraph' (an MPSGraph only), "
            "'mixed' (both paths ship; which one a decode shape takes is not in the binary), 'unknown'. Keyed by "
            "overload-packet name (OpOverload.overloadpacket.__name__). Evidence per row: the wheel's "
            "libtorch_cpu.dylib metallib kernel names matching 'metal_pattern' and the MPSGraph string literals "
            "found. Generated by tools/mps_dispatch_kinds.py; do not edit by hand."
        ),
        "source": "torch/lib/libtorch_cpu.dylib of the macOS arm64 wheel (metallib NAME tags; string literals)",
        "generated": dt.date.today().isoformat(),
        "wheels": [read(v, a.cache) for v in a.versions],
    }
    a.out.write_text(json.dumps(table, indent=1) + "\n")
    for w in table["wheels"]:
        kinds: dict[str, int] = {}
        for row in w["ops"].values():
            kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1
        print(w["version"], kinds)
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
