#!/usr/bin/env python
"""Read the released macOS arm64 torch wheels and write what each one ships for the MPS features of
mpsboost's version gate (``src/mpsboost/data/mps_wheels.json``).

The wheel ``pip install torch`` gives a Mac is the evidence for the gate's MPS column: its
``torch/lib/libtorch_cpu.dylib`` embeds the compiled Metal libraries (every kernel function is named
in a metallib ``NAME`` tag), its exported symbols and error strings, and ``torch/`` carries the
Python API. Each fact below is a list of checks on one wheel; a wheel shows the fact when every
check holds. The gate (``mpsboost.gate.FEATURES``) names a fact on each MPS rule it rests on
(``Rule.evidence``) and ``tests/core/test_wheel_evidence.py`` fails when the two disagree.

It also writes which aten ops have a kernel for MPS, or a composite one (``CompositeExplicitAutograd``,
``...NonFunctional``, ``CompositeImplicitAutograd``: written once for every backend), in each wheel
(``src/mpsboost/data/mps_ops.json``). The source is the wheel's ``torch/include/ATen/ops/``: a
``GROUP_mps_dispatch.h`` header declares the C++ functions of the ops of ``GROUP`` that have an MPS kernel,
and ``GROUP_ops.h`` declares every op of the group with its schema (``aten::NAME``, overload, argument
types). A header's file name is not an op's name (``lshift_mps_dispatch.h`` holds ``__lshift__`` and
``__ilshift__``), and a C++ name is not an overload (``add`` is ``add.Tensor``; ``add_outf`` is ``add.out``;
``X_symint`` takes SymInts), so each declaration is matched to the one op of its group with the same name
and argument types; a declaration matching none or two stops the tool. The op ids are the schema names
dispatch reports (``OpOverload.name()`` without ``aten::``: ``add.Tensor``, ``relu``).
``tests/integration/test_mps_kernels.py`` fails when a patched model under a release's Mac decisions
dispatches an aten op that has neither kernel in that release's wheel.

One command regenerates the files; run from the repository root::

    python tools/wheel_facts.py                  # every torch release >= 2.12 the index serves
    python tools/wheel_facts.py --versions 2.15.0 2.16.0 --cache /work/.wheelcache
    python tools/wheel_facts.py --offline        # only the wheels already in the cache

Downloads (about 140 MB each) go to ``--cache`` (default ``.wheelcache/`` at the repository root,
git-ignored) and are kept. pip is run with ``PIP_CONFIG_FILE=/dev/null`` so that a machine's pip
configuration (a constraints file that caps torch, say) cannot stop a download of a wheel that is
never installed. CI never runs this: the tests read the committed JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "mpsboost" / "data" / "mps_wheels.json"
OPS_OUT = ROOT / "src" / "mpsboost" / "data" / "mps_ops.json"
CACHE = ROOT / ".wheelcache"
PLATFORM = "macosx_14_0_arm64"  # pip accepts older tags too (macosx_11_0 wheels) for this platform
PYTHON = "3.12"
FIRST = Version("2.12.0")
DYLIB = "torch/lib/libtorch_cpu.dylib"
SAMPLES = 6  # matched names recorded per check and wheel


@dataclass(frozen=True)
class Check:
    """One test on a wheel.

    ``kind``: ``"kernel"`` (a regex over the Metal kernel function names), ``"native"`` (a regex over
    the bytes of libtorch_cpu.dylib: exported symbols, error strings), ``"file"`` (a path in the
    wheel), ``"text"`` (a regex over the text of the file ``path`` in the wheel). ``present=False``:
    the check holds when nothing matches.
    """

    kind: str
    pattern: str
    path: str = ""
    present: bool = True

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "pattern": self.pattern, "present": self.present}
        if self.path:
            d["path"] = self.path
        return d


@dataclass(frozen=True)
class Fact:
    name: str
    description: str
    # The name the gate's rule quotes ("kernel X in the 2.15.0 macOS wheel"); ``*`` stands for a suffix.
    symbol: str
    checks: tuple[Check, ...] = field(default_factory=tuple)


def K(pattern: str, present: bool = True) -> Check:
    return Check("kernel", pattern, present=present)


def N(pattern: str, present: bool = True) -> Check:
    return Check("native", pattern, present=present)


# The facts the gate's MPS rules rest on. Add one here, name it on the rule (Rule.evidence), rerun.
FACTS: tuple[Fact, ...] = (
    Fact(
        "triangular_solve_small",
        "Metal kernels for small triangular solves (pytorch#196900, written for the Gated DeltaNet chunk "
        "solve); MPSMatrixSolveTriangular gone (pytorch#196241)",
        "triangular_solve_small_16",
        (
            K(r"^triangular_solve_small_(16|32|64)$"),
            K(r"^triangular_solve_small_general_(16|32|64)$"),
            N(r"MPSMatrixSolveTriangular", present=False),
        ),
    ),
    Fact(
        "scaled_mm_few_rows",
        "float8 matrix-vector kernels of _scaled_mm for 1-4 rows (pytorch#197862)",
        "scaled_mm_few_rows_1_float8_e4m3fn",
        (K(r"^scaled_mm_few_rows_[1-4]_float8_e4m3fn$"), K(r"^scaled_mm_few_rows_[1-4]_bfloat$")),
    ),
    Fact(
        "scaled_mm_kernels",
        "float8 scaled_mm kernels on MPS behind aten::_scaled_mm_v2 (torch.nn.functional.scaled_mm); the error "
        "text accepts tensorwise or rowwise scales only",
        "scaled_mm_float8_e4m3fn",
        (
            K(r"^scaled_mm_float8_e4m3fn$"),
            N(r"MPS _scaled_mm_v2 only supports TensorWise or RowWise scaling"),
            N(r"wrapper_MPS__scaled_mm_v2"),  # F.scaled_mm's op; torch._scaled_mm (v1) has no MPS kernel
        ),
    ),
    Fact(
        "float8_kernels",
        "Metal copy kernels for float8_e4m3fn (the dtype on MPS, pytorch#194074)",
        "copy_identity_dense_castout_float8_e4m3fn",
        (K(r"^copy_identity_dense_castout_float8_e4m3fn$"),),
    ),
    Fact(
        "grouped_mm_kernels",
        "Metal grouped matmul kernels (pytorch#194917, #194933)",
        "grouped_mm_rows_bfloat_bm16_u32",
        (K(r"^grouped_mm_(rows|cols|k)_"), K(r"^grouped_mm_few_rows_"), N(r"grouped_mm_mps")),
    ),
    Fact(
        "histc_atomic_float",
        "histc on atomic Metal kernels, counts stay on the device (pytorch#196016)",
        "histc_atomic_global_float",
        (K(r"^histc_atomic_(global|threadgroup)_(float|half|bfloat)$"),),
    ),
    Fact(
        "histc_atomic_int",
        "histc Metal kernels for integer input",
        "histc_atomic_global_int",
        (K(r"^histc_atomic_(global|threadgroup)_(int|long)$"),),
    ),
    Fact(
        "constant_pad_kernel",
        "constant pad on a Metal kernel (pytorch#195368; fp8 pad #197801)",
        "constant_pad_nd_dense_float",
        (K(r"^constant_pad_nd_dense_(float|half|bfloat)$"),),
    ),
    Fact(
        "pad3d_kernels",
        "reflection and replication pad3d on Metal kernels (pytorch#195147): out of the MPSGraph path "
        "whose rank-5 pads were wrong",
        "reflection_pad3d_forward_*",
        (K(r"^reflection_pad3d_forward_(float|half|bfloat)"), K(r"^replication_pad3d_forward_(float|half|bfloat)")),
    ),
    Fact(
        "softmax_kernel",
        "softmax on a Metal kernel (pytorch#196071)",
        "softmax_float_u32",
        (K(r"^softmax_(float|half|bfloat)_u32$"),),
    ),
    Fact(
        "gemv_bias_kernels",
        "matrix-vector kernels with an alpha/beta (bias) epilogue for mm/addmm (pytorch#186927, #189628)",
        "gemv_t_bfloat_16_1_ab",
        (K(r"^gemv_t_(float|half|bfloat)_\d+_\d+_ab$"), K(r"^gemv_nt_(float|half|bfloat)_\d+_\d+_ab_")),
    ),
    Fact(
        "conv3d_kernels",
        "conv3d on Metal kernels (pytorch#188802, #192229)",
        "conv3d_simd_*",
        (K(r"^conv3d_(simd|mpp)_"),),
    ),
    Fact(
        "sdpa_prefill_kernels",
        "flash-style SDPA prefill kernels (pytorch#181575)",
        "prefill_attention_*",
        (K(r"^prefill_attention_(bfloat16|float16|float32)_bq"),),
    ),
    Fact(
        "sdpa_mpp_kernels",
        "SDPA prefill kernels on Metal Performance Primitives (pytorch#182256)",
        "prefill_attention_mpp_*",
        (K(r"^prefill_attention_mpp_"),),
    ),
    Fact(
        "sdpa_without_mpsgraph",
        "no MPSGraph SDPA path left (sdpa_general_mps building an MPSGraph CachedGraph): attention fully on Metal",
        "sdpa_general_mps",
        (N(r"sdpa_general_mps[A-Za-z0-9_]*CachedGraph", present=False),),
    ),
    Fact(
        "rms_norm_kernel",
        "rms_norm on a Metal kernel (pytorch#145301)",
        "rms_norm_float",
        (K(r"^rms_norm_(float|half|bfloat)$"),),
    ),
    Fact(
        "mps_streams",
        "user streams on MPS: torch/mps/streams.py (Stream, stream, set_stream) and record_stream on MPS",
        "torch/mps/streams.py",
        (
            Check("file", "torch/mps/streams.py"),
            Check("text", r"^class Stream\b", path="torch/mps/streams.py"),
            N(r"record_stream_mps"),
        ),
    ),
    Fact(
        "mps_cross_stream_events",
        "torch.mps.Event record/wait on a non-default stream (pytorch#194111): streams.py present and "
        "event.py no longer raising 'Non-default streams are not yet supported.'",
        "Non-default streams are not yet supported.",
        (
            Check("file", "torch/mps/streams.py"),
            Check("text", r"Non-default streams are not yet supported", path="torch/mps/event.py", present=False),
        ),
    ),
    Fact(
        "mps_compile_shader",
        "torch.mps.compile_shader",
        "def compile_shader",
        (Check("text", r"^def compile_shader\(", path="torch/mps/__init__.py"),),
    ),
    Fact(
        "mps_load_metallib",
        "torch.mps.load_metallib (pytorch#177276)",
        "def load_metallib",
        (Check("text", r"^def load_metallib\(", path="torch/mps/__init__.py"),),
    ),
)


# ----------------------------------------------------------------------------- reading a wheel

_NAME_TAG = re.compile(rb"NAME(..)([A-Za-z0-9_]+)\x00", re.S)


def metal_kernels(blob: bytes) -> set[str]:
    """Every function name of the metallibs embedded in ``blob``: a metallib's function list carries
    tagged fields, ``NAME`` + uint16 length + a NUL-terminated name."""
    names = set()
    for m in _NAME_TAG.finditer(blob):
        (n,) = struct.unpack("<H", m.group(1))
        if n == len(m.group(2)) + 1:
            names.add(m.group(2).decode())
    return names


def _printable_around(blob: bytes, start: int, end: int) -> str:
    lo, hi = start, end
    while lo > 0 and 0x20 <= blob[lo - 1] < 0x7F and start - lo < 200:
        lo -= 1
    while hi < len(blob) and 0x20 <= blob[hi] < 0x7F and hi - end < 200:
        hi += 1
    return blob[lo:hi].decode("ascii", "replace")


@dataclass
class Wheel:
    version: str
    path: Path
    kernels: set[str]
    dylib: bytes
    zf: zipfile.ZipFile

    def run(self, check: Check) -> list[str]:
        """What ``check`` matched in this wheel (empty: nothing)."""
        if check.kind == "kernel":
            rx = re.compile(check.pattern)
            return sorted(n for n in self.kernels if rx.search(n))
        if check.kind == "native":
            rx = re.compile(check.pattern.encode())
            found = []
            for m in rx.finditer(self.dylib):
                found.append(_printable_around(self.dylib, m.start(), m.end()))
                if len(found) >= 50:
                    break
            return sorted(set(found))
        if check.kind == "file":
            return [check.pattern] if check.pattern in self.zf.namelist() else []
        if check.kind == "text":
            try:
                text = self.zf.read(check.path).decode("utf-8", "replace")
            except KeyError:
                return []
            return sorted({m.group(0) for m in re.finditer(check.pattern, text, re.M)})
        raise ValueError(f"unknown check kind {check.kind!r}")

    def has_symbol(self, fact: Fact) -> bool:
        """Does this wheel carry the name ``fact`` quotes: a kernel (``*`` for any suffix), bytes of
        libtorch_cpu.dylib, a file of the wheel, or text in a file one of the fact's checks reads."""
        sym = fact.symbol
        if any(fnmatch.fnmatchcase(n, sym) for n in self.kernels):
            return True
        if "*" not in sym and sym.encode() in self.dylib:
            return True
        if sym in self.zf.namelist():
            return True
        for c in fact.checks:
            if c.kind == "text":
                try:
                    if sym in self.zf.read(c.path).decode("utf-8", "replace"):
                        return True
                except KeyError:
                    pass
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _macos_from_tag(filename: str) -> str:
    m = re.search(r"macosx_(\d+)_(\d+)_", filename)
    if not m:
        raise ValueError(f"{filename}: no macOS platform tag")
    return f"{m.group(1)}.{m.group(2)}"


# ----------------------------------------------------------------------------- the aten ops with a kernel

OPS_DIR = "torch/include/ATen/ops/"
# The dispatch keys whose kernels serve an MPS tensor: MPS itself and the composite keys (a composite kernel is
# written once for every backend, from other ops). CompositeImplicitAutogradNestedTensor serves nested tensors only.
COMPOSITE_KEYS = ("compositeexplicitautograd", "compositeexplicitautogradnonfunctional", "compositeimplicitautograd")
_DISPATCH_H = re.compile(r"^(?P<group>.+)_(?P<key>[a-z]+)_dispatch\.h$")
_DECL = re.compile(r"^TORCH_API\s+.+?\s+([A-Za-z_][A-Za-z0-9_]*)\((.*)\);\s*$", re.M)
_OP_STRUCT = re.compile(r"struct TORCH_API \w+ \{(.*?)\n\};", re.S)
_SCHEMA = re.compile(r'schema_str = "((?:[^"\\]|\\.)*)"')
# A SymInt argument is declared with SymInt types in *_ops.h, and with plain ints by a dispatch header's
# non-symint twin: compare them as one type.
_SAME_TYPE = (
    ("c10::SymIntArrayRef", "at::IntArrayRef"),
    ("at::OptionalSymIntArrayRef", "at::OptionalIntArrayRef"),
    ("c10::SymInt", "int64_t"),
)
_OPTIONS = ("::std::optional<at::ScalarType>", "::std::optional<at::Layout>", "::std::optional<at::Device>",
            "::std::optional<bool>")  # fmt: skip


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch in "<({[" and 1 or (ch in ">)}]" and -1 or 0)
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def _param_types(params: str) -> tuple[str, ...]:
    """The argument types of a C++ declaration, without names, defaults, const and references;
    ``at::TensorOptions`` as the four optionals of the schema it packs."""
    types: list[str] = []
    for p in _split_params(params):
        p = p.split("=", 1)[0].strip()
        t = re.sub(r"\s*[A-Za-z_][A-Za-z0-9_]*$", "", p).replace("const ", "").replace("&", "").replace(" ", "")
        for a, b in _SAME_TYPE:
            t = t.replace(a, b)
        types.extend(_OPTIONS if t == "at::TensorOptions" else (t,))
    return tuple(types)


@dataclass(frozen=True)
class AtenOp:
    name: str  # aten::NAME, without "aten::"
    schema_name: str  # NAME or NAME.OVERLOAD: what OpOverload.name() reports, without "aten::"
    types: tuple[str, ...]
    out: bool  # an out= variant: a mutable keyword-only argument


def group_ops(text: str) -> list[AtenOp]:
    """Every op a ``GROUP_ops.h`` declares."""
    ops = []
    for m in _OP_STRUCT.finditer(text):
        body = m.group(1)
        name = re.search(r'static constexpr const char\* name = "aten::([^"]+)"', body)
        schema = _SCHEMA.search(body)
        call = re.search(r"static .*? call\((.*)\);", body)
        if not (name and schema and call):
            raise ValueError(f"cannot read an op of *_ops.h: {body[:200]!r}")
        head, rest = schema.group(1).split("(", 1)
        args = rest.rsplit(") ->", 1)[0]
        out = "*" in args and "!" in args.split("*", 1)[1]
        ops.append(AtenOp(name.group(1), head, _param_types(call.group(1)), out))
    return ops


def dispatch_header_ops(header: str, ops: list[AtenOp]) -> set[str]:
    """The schema names of the ops whose kernel ``header`` (a ``GROUP_KEY_dispatch.h``) declares.

    ``X_out`` has its out arguments first; its twin ``X_outf`` keeps the schema's order, so only the
    latter is matched. ``X_symint`` and ``X_symint_outf`` are the SymInt forms of op ``X``."""
    decls = [(m.group(1), m.group(2)) for m in _DECL.finditer(header)]
    declared = {d for d, _ in decls}
    found = set()
    for fname, params in decls:
        if fname + "f" in declared:
            continue
        outf = fname.endswith("_outf")
        names = {fname} | {fname[: -len(s)] for s in ("_symint_outf", "_outf", "_symint") if fname.endswith(s)}
        types = _param_types(params)
        hits = {op.schema_name for op in ops if op.name in names and op.types == types and op.out == outf}
        if len(hits) != 1:
            raise ValueError(f"{fname}({params}) matches {sorted(hits) or 'no op'} of its group")
        found |= hits
    return found


def kernel_ops(names: list[str], read, keys: dict[str, tuple[str, ...]]) -> dict[str, set[str]]:
    """``{label: schema names}``: the ops with a kernel for the dispatch keys of each label
    (e.g. ``{"mps": ("mps",), "composite": COMPOSITE_KEYS}``), read from the headers among ``names`` (paths
    in a wheel or an install, under ``torch/include/ATen/ops/``); ``read(path)`` returns a file's text."""
    want = {k: label for label, ks in keys.items() for k in ks}
    out: dict[str, set[str]] = {label: set() for label in keys}
    groups: dict[str, list[AtenOp]] = {}
    for path in names:
        if not path.startswith(OPS_DIR):
            continue
        m = _DISPATCH_H.match(path[len(OPS_DIR) :])
        if not m or m.group("key") not in want:
            continue
        group = m.group("group")
        if group not in groups:
            groups[group] = group_ops(read(f"{OPS_DIR}{group}_ops.h"))
        try:
            out[want[m.group("key")]] |= dispatch_header_ops(read(path), groups[group])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return out


def wheel_ops(zf: zipfile.ZipFile) -> dict[str, set[str]]:
    """The aten ops with an MPS kernel, and those with a composite one, in a wheel."""
    return kernel_ops(zf.namelist(), lambda p: zf.read(p).decode(), {"mps": ("mps",), "composite": COMPOSITE_KEYS})


def ops_table(per_wheel: list[tuple[dict, dict[str, set[str]]]]) -> dict:
    """The committed form: the oldest wheel's op lists in full, every later wheel's as what it adds and
    removes against the one before (:func:`ops_of` in the tests reads it back)."""
    wheels, prev = [], None
    for w, ops in per_wheel:
        rec = {k: w[k] for k in ("version", "file", "sha256")}
        for label in ("mps", "composite"):
            if prev is None:
                rec[label] = sorted(ops[label])
            else:
                rec[f"{label}_added"] = sorted(ops[label] - prev[label])
                rec[f"{label}_removed"] = sorted(prev[label] - ops[label])
        rec["count"] = {label: len(ops[label]) for label in ("mps", "composite")}
        wheels.append(rec)
        prev = ops
    return {
        "about": (
            "The aten ops with an MPS kernel ('mps') and with a composite kernel ('composite': "
            "CompositeExplicitAutograd, CompositeExplicitAutogradNonFunctional, CompositeImplicitAutograd) in each "
            "released macOS arm64 torch wheel, as schema names (OpOverload.name() without 'aten::'). The first wheel "
            "lists them in full; each later one what it adds and removes against the one before; 'count' is the "
            "size of each set. Generated by tools/wheel_facts.py from torch/include/ATen/ops/*_dispatch.h and "
            "*_ops.h; do not edit by hand."
        ),
        "generated": dt.date.today().isoformat(),
        "platform": PLATFORM,
        "python": f"cp{PYTHON.replace('.', '')}",
        "wheels": wheels,
    }


def read_ops_table(table: dict) -> dict[str, dict[str, frozenset[str]]]:
    """``{version: {"mps": ops, "composite": ops}}`` from the committed form :func:`ops_table` writes."""
    out: dict[str, dict[str, frozenset[str]]] = {}
    prev: dict[str, frozenset[str]] | None = None
    for w in table["wheels"]:
        cur = {}
        for label in ("mps", "composite"):
            if prev is None:
                cur[label] = frozenset(w[label])
            else:
                cur[label] = (prev[label] - set(w[f"{label}_removed"])) | set(w[f"{label}_added"])
            if len(cur[label]) != w["count"][label]:
                raise ValueError(f"{w['version']}: {len(cur[label])} {label} read back, the table says {w['count']}")
        out[w["version"]] = cur
        prev = cur
    return out


# ----------------------------------------------------------------------------- the index


def _pip_env() -> dict:
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull  # ignore every pip config file (a torch cap, extra indexes)
    for var in ("PIP_CONSTRAINT", "PIP_FIND_LINKS"):  # local folders may hold other builds (a +cpu wheel)
        env.pop(var, None)
    return env


def released_versions() -> list[str]:
    """Every torch release >= 2.12 that the package index serves."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "torch"],
        env=_pip_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = re.search(r"Available versions:\s*(.+)", out)
    if not m:
        raise SystemExit(f"cannot read the versions pip index reports:\n{out}")
    vs = [Version(v.strip()) for v in m.group(1).split(",")]
    keep = (v for v in vs if v >= FIRST and not v.is_prerelease and not v.is_devrelease and not v.local)
    return [str(v) for v in sorted(keep)]


def wheel_file(version: str, cache: Path, offline: bool) -> Path:
    pattern = f"torch-{version}-cp{PYTHON.replace('.', '')}-*-macosx_*_arm64.whl"
    hits = sorted(cache.glob(pattern))
    if hits:
        return hits[0]
    if offline:
        raise SystemExit(f"--offline: no wheel for torch {version} in {cache} ({pattern})")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--platform", PLATFORM, "--python-version", PYTHON, "--implementation", "cp",
        f"torch=={version}", "-d", str(cache), "-q",
    ]  # fmt: skip
    print(f"downloading torch {version} ({PLATFORM}, cp{PYTHON})", file=sys.stderr)
    subprocess.run(cmd, env=_pip_env(), check=True)
    hits = sorted(cache.glob(pattern))
    if not hits:
        raise SystemExit(f"pip downloaded no file matching {pattern} into {cache}")
    return hits[0]


# ----------------------------------------------------------------------------- the evidence


def read_wheel(version: str, path: Path) -> Wheel:
    zf = zipfile.ZipFile(path)
    dylib = zf.read(DYLIB)
    return Wheel(version, path, metal_kernels(dylib), dylib, zf)


def evidence(versions: list[str], cache: Path, offline: bool) -> tuple[dict, dict]:
    wheels_out, facts_out = (
        [],
        {
            f.name: {
                "description": f.description,
                "symbol": f.symbol,
                "checks": [c.to_dict() for c in f.checks],
                "shows": {},
                "matched": {},
                "symbol_in": [],
                "first": None,
            }
            for f in FACTS
        },
    )
    ops_per_wheel = []
    for version in sorted(versions, key=Version):
        path = wheel_file(version, cache, offline)
        print(f"reading {path.name}", file=sys.stderr)
        w = read_wheel(version, path)
        wheels_out.append(
            {
                "version": version,
                "file": path.name,
                "sha256": _sha256(path),
                "size": path.stat().st_size,
                "min_macos": _macos_from_tag(path.name),
                "metal_kernels": len(w.kernels),
            }
        )
        ops_per_wheel.append((wheels_out[-1], wheel_ops(w.zf)))
        for f in FACTS:
            rec = facts_out[f.name]
            results = [w.run(c) for c in f.checks]
            shows = all(bool(r) == c.present for r, c in zip(results, f.checks))
            rec["shows"][version] = shows
            if w.has_symbol(f):
                rec["symbol_in"].append(version)
            seen = [r[:SAMPLES] for r in results]
            if any(seen):
                rec["matched"][version] = seen
            if shows and rec["first"] is None:
                rec["first"] = version
        w.zf.close()
        del w
    return {
        "about": (
            "What each released macOS arm64 torch wheel ships for the MPS features of mpsboost's version gate. "
            "Generated by tools/wheel_facts.py; do not edit by hand. A fact 'shows' in a wheel when each of its "
            "checks holds (present=false: the pattern must not match)."
        ),
        "generated": dt.date.today().isoformat(),
        "platform": PLATFORM,
        "python": f"cp{PYTHON.replace('.', '')}",
        "source": "torch/lib/libtorch_cpu.dylib (metallib NAME tags; bytes) and torch/*.py of each wheel",
        "wheels": wheels_out,
        "facts": facts_out,
    }, ops_table(ops_per_wheel)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", nargs="*", help="torch releases to read (default: every release >= 2.12 served)")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("MPSBOOST_WHEEL_CACHE", CACHE)))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--ops-out", type=Path, default=OPS_OUT, help="where the aten op table goes")
    p.add_argument("--offline", action="store_true", help="read cached wheels only; never download")
    a = p.parse_args(argv)
    if a.versions:
        versions = a.versions
    elif a.offline:
        versions = sorted(
            {m.group(1) for f in a.cache.glob("torch-*.whl") if (m := re.match(r"torch-([\d.]+)-", f.name))},
            key=Version,
        )
        versions = [v for v in versions if Version(v) >= FIRST]
    else:
        versions = released_versions()
    data, ops = evidence(versions, a.cache, a.offline)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    a.ops_out.write_text(json.dumps(ops, indent=1, sort_keys=False) + "\n")
    for name, rec in data["facts"].items():
        print(f"{name:26} first: {rec['first'] or '-':8} " + " ".join(
            f"{v}:{'y' if s else '.'}" for v, s in rec["shows"].items()
        ))  # fmt: skip
    for w in ops["wheels"]:
        print(f"aten ops {w['version']:8} mps: {w['count']['mps']:5} composite: {w['count']['composite']:5}")
    print(f"wrote {a.out} and {a.ops_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
