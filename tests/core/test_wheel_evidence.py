"""The gate's MPS column against what the released macOS torch wheels ship (data/mps_wheels.json).

The evidence file is written by tools/wheel_facts.py from the wheels themselves (Metal kernel names
in libtorch_cpu.dylib, symbols, error strings, torch/*.py); these tests never download anything.
Every MPS rule names its evidence (``Rule.evidence``): a fact of the file, or BEHAVIOURAL.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from importlib import resources
from pathlib import Path

import pytest
from packaging.version import Version

from mpsboost import gate
from mpsboost.gate import BEHAVIOURAL, FEATURES, Env, check, wheel_evidence

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    """tools/wheel_facts.py, imported by path (a developer script outside the package)."""
    name = "_mpsboost_wheel_facts"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "wheel_facts.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _mps_rules():
    for feat in FEATURES.values():
        for i, rule in enumerate(feat.rules.get("mps", ())):
            yield pytest.param(feat, rule, id=f"{feat.name}-{i}")


def _minor(text: str) -> tuple[int, int]:
    return Version(text).release[:2]


def test_evidence_file_names_each_wheel_and_its_hash():
    ev = wheel_evidence()
    versions = [w["version"] for w in ev["wheels"]]
    assert versions == sorted(versions, key=Version)
    assert {"2.12.1", "2.13.0", "2.14.1", "2.15.0"} <= set(versions)
    for w in ev["wheels"]:
        assert w["file"].startswith(f"torch-{w['version']}-cp312-cp312-macosx_") and w["file"].endswith("_arm64.whl")
        assert re.fullmatch(r"[0-9a-f]{64}", w["sha256"])
        assert w["metal_kernels"] > 1000  # the metallib parser found the kernels
    # The 2.15.0 wheel is tagged macosx_14_0: torch 2.15 on a Mac needs macOS 14 or later.
    (w215,) = [w for w in ev["wheels"] if w["version"] == "2.15.0"]
    assert w215["min_macos"] == "14.0"
    for fact in ev["facts"].values():
        assert list(fact["shows"]) == versions  # every fact read from every wheel


@pytest.mark.parametrize("feat,rule", list(_mps_rules()))
def test_every_mps_rule_agrees_with_the_wheels(feat, rule):
    """``since`` is the first release whose wheel shows the fact (or earlier, when the oldest wheel read
    already has it); a rule that no release has yet names the fact the newest wheel lacks."""
    assert rule.evidence, f"{feat.name}: the MPS rule names no evidence (a fact of data/mps_wheels.json or BEHAVIOURAL)"
    if rule.evidence == BEHAVIOURAL:
        assert "behavioural" in rule.upstream and "#" in rule.upstream, (
            f"{feat.name}: a behavioural rule says so and keeps its pull request or issue: {rule.upstream!r}"
        )
        return
    ev = wheel_evidence()
    fact = ev["facts"].get(rule.evidence)
    assert fact is not None, f"{feat.name}: fact {rule.evidence!r} is not in data/mps_wheels.json"
    versions = [w["version"] for w in ev["wheels"]]
    first = fact["first"]
    assert fact["symbol"] in rule.upstream, f"{feat.name}: the rule's text does not quote {fact['symbol']!r}"
    if first is None:
        newest = versions[-1]
        assert rule.never or rule.nightly_only, (
            f"{feat.name}: no macOS wheel up to {newest} shows {rule.evidence}, but the gate says since {rule.since}"
        )
        assert f"{newest} macOS wheel" in rule.upstream, f"{feat.name}: name the {newest} wheel that lacks it"
        if any(not c["present"] for c in fact["checks"]):
            # what stands in the way is in the newest wheel (an error text, the old path's symbol)
            assert newest in fact["symbol_in"], f"{feat.name}: {fact['symbol']!r} is not in the {newest} wheel"
        return
    assert not rule.never and not rule.nightly_only, (
        f"{feat.name}: the {first} macOS wheel shows {rule.evidence}, but the gate says {rule.first_release}"
    )
    assert rule.since is not None
    if first == versions[0]:
        # present in the oldest wheel read: the gate may date it earlier (from its pull request)
        assert _minor(rule.since) <= _minor(first), f"{feat.name}: since {rule.since}, yet the {first} wheel has it"
        assert "every macOS wheel read" in rule.upstream
    else:
        assert _minor(rule.since) == _minor(first), (
            f"{feat.name}: since {rule.since}, but the first macOS wheel that shows {rule.evidence} is {first}"
        )
        assert f"{first} macOS wheel" in rule.upstream, f"{feat.name}: the text must name the {first} wheel"
    # The quoted name is one the wheel really has (a '*' in it stands for any suffix).
    assert first in fact["symbol_in"], f"{feat.name}: {fact['symbol']!r} is not in the {first} wheel"


def test_every_fact_backs_a_rule():
    used = {r.evidence for f in FEATURES.values() for r in f.rules.get("mps", ())}
    assert set(wheel_evidence()["facts"]) <= used


def test_the_committed_file_matches_the_tool():
    """tools/wheel_facts.py and the committed file list the same facts with the same checks: a fact
    changed in the tool without rerunning it fails here."""
    mod = _tool()
    facts = wheel_evidence()["facts"]
    assert [f.name for f in mod.FACTS] == list(facts)
    for f in mod.FACTS:
        assert [c.to_dict() for c in f.checks] == facts[f.name]["checks"], f.name
        assert f.symbol == facts[f.name]["symbol"]


def test_the_kernel_reader_finds_metallib_names():
    mod = _tool()
    # two function-list entries as a metallib stores them: NAME, uint16 length (with the NUL), name, NUL
    blob = b"xxNAME\x1a\x00triangular_solve_small_16\x00TYPE\x01\x00\x00NAME\x05\x00abcd\x00NAME\x09\x00bad\x00"
    assert mod.metal_kernels(blob) == {"triangular_solve_small_16", "abcd"}


def test_mps_215_decisions_from_the_wheel():
    """What the 2.15.0 wheel ships, as the gate now answers it, with the evidence in the reason."""
    e215, e214 = Env.simulate("mps", "2.15.0"), Env.simulate("mps", "2.14.1")
    solve = check("solve_triangular_fast", e215)
    assert solve.ok and "triangular_solve_small_16" in solve.reason and "2.15.0 macOS wheel" in solve.reason
    assert not check("solve_triangular_fast", e214).ok
    gemv = check("fp8_gemv", e215)
    assert gemv.ok and "scaled_mm few-rows" in gemv.reason and "tensorwise or rowwise" in gemv.reason
    assert check("histc_int", e215).ok and check("histc_no_host_sync", e215).ok
    assert not check("histc_int", e214).ok
    assert check("device_streams", e215).ok
    events = check("cross_stream_events", e215)
    assert not events.ok and "Non-default streams are not yet supported." in events.reason
    assert check("cross_stream_events", Env.simulate("mps", "2.16.0.dev20261201")).ok
    assert check("gemv_bias_epilogue", Env.simulate("mps", "2.14.0")).ok
    assert not check("sdpa_mpp_attention", Env.simulate("mps", "2.13.0", macos="26.2")).ok


def test_evidence_text_per_rule():
    (solve,) = FEATURES["solve_triangular_fast"].rules["mps"]
    assert gate.evidence_text(solve) == "triangular_solve_small_16 from the 2.15.0 macOS wheel"
    (rms,) = FEATURES["rms_norm_fused"].rules["mps"]
    assert gate.evidence_text(rms).startswith("rms_norm_float in every macOS wheel read (2.12.")
    (events,) = FEATURES["cross_stream_events"].rules["mps"]
    assert gate.evidence_text(events).startswith("not shown by any macOS wheel up to 2.15.0")
    (gqa,) = FEATURES["sdpa_metal_gqa"].rules["mps"]
    assert gate.evidence_text(gqa).startswith("behavioural") and "pytorch#183280" in gqa.upstream


def test_qwen35_prefill_on_mps_215_uses_solve_triangular_with_the_kernel_named():
    """The Gated DeltaNet chunk solve: solve_triangular on 2.15 (the wheel's small triangular-solve kernels),
    and the plan's reason says which kernel and which wheel."""
    import mpsboost
    from tiny_models import build

    model = build("qwen3_5_moe")
    (row,) = mpsboost.plan(model, env=Env.simulate("mps", "2.15.0"), recipes=["linear_attention"]).rows[:1]
    assert "prefill chunked, solve_triangular" in row.backing
    assert "triangular_solve_small_16 in the 2.15.0 macOS wheel" in row.reason
    (old,) = mpsboost.plan(model, env=Env.simulate("mps", "2.14.1"), recipes=["linear_attention"]).rows[:1]
    assert "solve_triangular" not in old.backing and "2.14.1" in old.reason


# ------------------------------------------------------------------------------ the aten ops with an MPS kernel


def _op_struct(cls: str, name: str, schema: str, call: str) -> str:
    """One op as a GROUP_ops.h declares it (the generated form, abridged)."""
    return (
        f"struct TORCH_API {cls} {{\n  using schema = void ();\n"
        f'  static constexpr const char* name = "aten::{name}";\n'
        f'  static constexpr const char* overload_name = "";\n'
        f'  static constexpr const char* schema_str = "{schema}";\n'
        f"  static at::Tensor call({call});\n}};\n"
    )


_LSHIFT_OPS = "".join(
    (
        _op_struct(
            "__lshift___Scalar",
            "__lshift__",
            "__lshift__.Scalar(Tensor self, Scalar other) -> Tensor",
            "const at::Tensor & self, const at::Scalar & other",
        ),
        _op_struct(
            "__lshift___Tensor",
            "__lshift__",
            "__lshift__.Tensor(Tensor self, Tensor other) -> Tensor",
            "const at::Tensor & self, const at::Tensor & other",
        ),
        _op_struct(
            "__ilshift___Scalar",
            "__ilshift__",
            "__ilshift__.Scalar(Tensor(a!) self, Scalar other) -> Tensor(a!)",
            "at::Tensor & self, const at::Scalar & other",
        ),
        _op_struct(
            "__lshift___Scalar_out",
            "__lshift__",
            "__lshift__.Scalar_out(Tensor self, Scalar other, *, Tensor(a!) out) -> Tensor(a!)",
            "const at::Tensor & self, const at::Scalar & other, at::Tensor & out",
        ),
        _op_struct(
            "constant_pad_nd",
            "constant_pad_nd",
            'constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0, str mode=\\"x\\") -> Tensor',
            "const at::Tensor & self, c10::SymIntArrayRef pad, const at::Scalar & value",
        ),
    )
)


def test_the_header_reader_maps_declarations_to_overloads():
    """A header's file name is not an op name (lshift_mps_dispatch.h holds __lshift__ and __ilshift__), a C++
    name is not an overload: each declaration goes to the one op of its group with its name and argument types
    (X_outf to the out= overload, X_symint to the SymInt op, an X_out twin skipped)."""
    mod = _tool()
    ops = mod.group_ops(_LSHIFT_OPS)
    assert [o.schema_name for o in ops] == [
        "__lshift__.Scalar",
        "__lshift__.Tensor",
        "__ilshift__.Scalar",
        "__lshift__.Scalar_out",
        "constant_pad_nd",
    ]
    assert [o.out for o in ops] == [False, False, False, True, False]  # in-place is not out=
    header = (
        "TORCH_API at::Tensor __lshift__(const at::Tensor & self, const at::Scalar & other);\n"
        "TORCH_API at::Tensor & __ilshift__(at::Tensor & self, const at::Scalar & other);\n"
        "TORCH_API at::Tensor & __lshift___out(at::Tensor & out, const at::Tensor & self, const at::Scalar & other);\n"
        "TORCH_API at::Tensor & __lshift___outf(const at::Tensor & self, const at::Scalar & other, at::Tensor & out);\n"
        "TORCH_API at::Tensor constant_pad_nd(const at::Tensor & self, at::IntArrayRef pad, const at::Scalar & v=0);\n"
        "TORCH_API at::Tensor constant_pad_nd_symint(const at::Tensor & self, c10::SymIntArrayRef pad, "
        "const at::Scalar & value=0);\n"
    )
    assert mod.dispatch_header_ops(header, ops) == {
        "__lshift__.Scalar",
        "__ilshift__.Scalar",
        "__lshift__.Scalar_out",
        "constant_pad_nd",
    }
    # one declaration that matches no op of its group stops the tool (a reader that guessed would mislabel)
    with pytest.raises(ValueError, match="matches no op"):
        mod.dispatch_header_ops("TORCH_API at::Tensor __lshift__(const at::Tensor & self, double x);\n", ops)
    files = {
        "torch/include/ATen/ops/lshift_ops.h": _LSHIFT_OPS,
        "torch/include/ATen/ops/lshift_mps_dispatch.h": header,
        "torch/include/ATen/ops/lshift_cpu_dispatch.h": header,  # another backend: not read for MPS
        "torch/include/ATen/ops/lshift_compositeimplicitautogradnestedtensor_dispatch.h": header,  # nested only
    }
    got = mod.kernel_ops(list(files), files.__getitem__, {"mps": ("mps",), "composite": mod.COMPOSITE_KEYS})
    assert got == {"mps": mod.dispatch_header_ops(header, ops), "composite": set()}


def _installed_headers() -> tuple[list[str], object]:
    import torch

    site = Path(torch.__file__).resolve().parents[1]
    ops_dir = site / "torch" / "include" / "ATen" / "ops"
    if not ops_dir.is_dir():
        pytest.skip(f"this torch install ships no ATen headers ({ops_dir})")
    names = [f"torch/include/ATen/ops/{n}" for n in sorted(p.name for p in ops_dir.iterdir())]
    return names, lambda p: (site / p).read_text()


def test_the_header_reader_agrees_with_this_builds_dispatcher():
    """The same reader on this install's headers, against this process's dispatcher: every op it finds for the
    CPU and composite keys is registered there, and the registered ops it misses have no generated header (kernels
    registered by hand, e.g. quantized_lstm on the CPU)."""
    import torch

    mod = _tool()
    names, read = _installed_headers()
    got = mod.kernel_ops(names, read, {"cpu": ("cpu",), "composite": mod.COMPOSITE_KEYS})
    aten = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]

    def registered(keys):
        return {n[6:] for n in aten if any(torch._C._dispatch_has_kernel_for_dispatch_key(n, k) for k in keys)}

    composite = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")
    for label, keys, key in (("cpu", ("CPU",), "cpu"), ("composite", composite, "compositeexplicitautograd")):
        ref = registered(keys)
        assert got[label] and got[label] <= ref, sorted(got[label] - ref)[:10]
        missed = ref - got[label]
        assert len(missed) < 0.02 * len(ref), sorted(missed)[:20]
        headers = {n.rsplit("/", 1)[1] for n in names}
        for op in missed:
            base = op.split(".")[0]
            assert f"{base}_{key}_dispatch.h" not in headers, f"{op}: its header exists but the reader missed it"


def test_the_op_table_is_the_tools_reading_of_the_evidence_wheels():
    """data/mps_ops.json names the wheels of data/mps_wheels.json (same files, same hashes), reads back to the
    sets whose sizes it states, agrees with the Metal-kernel facts (grouped_mm and _scaled_mm_v2 gain MPS kernels
    in 2.15.0), and for this build's release its composite ops are this install's."""
    mod = _tool()
    table_json = json.loads(resources.files("mpsboost").joinpath("data/mps_ops.json").read_text())
    ev = wheel_evidence()
    assert [(w["version"], w["file"], w["sha256"]) for w in table_json["wheels"]] == [
        (w["version"], w["file"], w["sha256"]) for w in ev["wheels"]
    ]
    table = mod.read_ops_table(table_json)
    keys = ("version", "file", "sha256")
    again = mod.ops_table([({k: w[k] for k in keys}, table[w["version"]]) for w in ev["wheels"]])
    assert again["wheels"] == table_json["wheels"]
    for op, fact in (("_grouped_mm", "grouped_mm_kernels"), ("_scaled_mm_v2", "scaled_mm_kernels")):
        with_kernel = [v for v in table if op in table[v]["mps"]]
        assert with_kernel and with_kernel[0] == ev["facts"][fact]["first"], (op, with_kernel)
    # every release: the ops of a decode step are there (the table is not empty or truncated)
    for v, t in table.items():
        assert {"mm", "add.Tensor", "_softmax", "index_select", "_scaled_dot_product_attention_math_for_mps"} <= t[
            "mps"
        ], v
        assert {"copy_", "scaled_dot_product_attention"} <= t["composite"] - t["mps"], v
    import torch

    here = ".".join(str(x) for x in Version(torch.__version__).release[:3])
    if here not in table:
        pytest.skip(f"torch {here} has no macOS wheel in the table")
    names, read = _installed_headers()
    mine = mod.kernel_ops(names, read, {"composite": mod.COMPOSITE_KEYS})["composite"]
    assert mine == table[here]["composite"]  # the composite kernels are the same in every build of a release
