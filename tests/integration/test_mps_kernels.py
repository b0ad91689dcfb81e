"""The MPS kernel check: a patched model, under a release's Mac decisions, dispatches only aten ops that the
release's macOS wheel can run on MPS.

``src/mpsboost/data/mps_ops.json`` (written by ``tools/wheel_facts.py`` from each wheel's
``torch/include/ATen/ops/*_dispatch.h`` headers) lists, per released macOS arm64 wheel, the aten ops with an
MPS kernel and those with a composite one (CompositeExplicitAutograd, ...NonFunctional,
CompositeImplicitAutograd: written once for every backend). An op with neither raises on a Mac (``The operator
'aten::X' is not currently implemented for the MPS device``), or falls back to the CPU where the user set
``PYTORCH_ENABLE_MPS_FALLBACK``.

Each case builds a tiny seed model (Qwen3.5/3.6-MoE with Gated DeltaNet, attention and MoE layers; Qwen3-MoE;
the Qwen-Image 1.0 / 2.1 and Wan 2.1 / 2.2 VAEs), patches it with the default recipes (and with
``fp8="rowwise"`` for the language models) for ``Env.simulate("mps", release)``, runs its prefill and decode
steps (a VAE: encode and decode) on the CPU under one op recorder
(:class:`mpsboost.bench.decode_cost.OpRecorder`) and names every aten op the release's wheel has no kernel for.

The run is on the CPU, so a few CPU-only backend choices are translated into what the MPS build dispatches
instead (:data:`ON_MPS_INSTEAD`; each translation is checked against the table). Ops of other namespaces
(mpsboost's registered operators) must have an MPS or a composite kernel registered in this process.

What it cannot see: the ops a composite kernel decomposes into on MPS, and kernels registered by hand outside
the generated headers (``test_wheel_evidence.py`` shows there are a few, on the CPU, none on the paths here).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from importlib import resources
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import mpsboost
import tiny_models as tm
from mpsboost.bench.decode_cost import OpRecorder
from mpsboost.gate import FEATURES, Env

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    name = "_mpsboost_wheel_facts"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "wheel_facts.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


TABLE_JSON = json.loads(resources.files("mpsboost").joinpath("data/mps_ops.json").read_text())
TABLE = _tool().read_ops_table(TABLE_JSON)


def _releases() -> list[str]:
    """The releases the gate tells apart on MPS: for every minor version an MPS rule starts at, the newest
    release of it with a wheel in the table (2.13.0, 2.14.1, 2.15.0 today)."""
    minors = {
        Version(r.since).release[:2]
        for f in FEATURES.values()
        for r in f.rules.get("mps", ())
        if r.since and not r.nightly_only and not r.never
    }
    out = []
    for minor in sorted(minors):
        have = [v for v in TABLE if Version(v).release[:2] == minor]
        if have:
            out.append(max(have, key=Version))
    return out


RELEASES = _releases()

# The CPU's choice of kernel -> what the same call dispatches on MPS. scaled_dot_product_attention is
# CompositeImplicitAutograd: it picks a backend's op by device (aten/src/ATen/native/transformers/attention.cpp):
# the CPU's fused flash kernel; on MPS _scaled_dot_product_attention_math_for_mps (inputs that fit its Metal
# kernels) or the composite _scaled_dot_product_attention_math.
ON_MPS_INSTEAD: dict[str, tuple[str, ...]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "_scaled_dot_product_attention_math_for_mps",
        "_scaled_dot_product_attention_math",
    ),
}

LMS = ("qwen3_5_moe", "qwen3_moe")
VAES = ("qwen_image_vae", "qwen_image21_vae", "wan21_vae", "wan22_vae")


def served(release: str, table: dict = TABLE) -> frozenset[str]:
    t = table[release]
    return t["mps"] | t["composite"]


def unserved(seen: dict[str, str], release: str, table: dict = TABLE) -> list[str]:
    """Every op of ``seen`` (op name -> where it was first dispatched) that ``release``'s macOS wheel cannot
    run: an aten op with neither an MPS nor a composite kernel there (after :data:`ON_MPS_INSTEAD`), or an
    op of another namespace with neither kernel registered here."""
    ok = served(release, table)
    bad = []
    for name, where in sorted(seen.items()):
        ns, _, op = name.partition("::")
        if ns == "aten":
            missing = [o for o in ON_MPS_INSTEAD.get(op, (op,)) if o not in ok]
            if missing:
                bad.append(f"aten::{', aten::'.join(missing)} ({where})")
        elif name not in torch._C._dispatch_get_all_op_names() or not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
            for key in ("MPS", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
        ):
            bad.append(f"{name}: no MPS or composite kernel registered ({where})")
    return bad


def record(model: torch.nn.Module, name: str) -> dict[str, str]:
    """Run ``model`` (tiny model ``name``) once under the op recorder: ``{op name: "phase, module"}`` where
    it was first seen; a language model's first call is its prefill, the later ones its decode steps."""
    seen: dict[str, str] = {}
    calls = [0]
    stack: list[str] = []

    def enter(m, a, path: str) -> None:  # hooks return None: a forward hook's value replaces the output
        if not path:
            calls[0] += 1
        stack.append(path)

    def leave(m, a, o) -> None:
        stack.pop()

    hooks = []
    for path, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(lambda m, a, p=path: enter(m, a, p)))
        hooks.append(mod.register_forward_hook(leave))
    lm = tm.TINY[name].kind == "lm"

    def note(func, args, kwargs, out) -> None:
        op = func.name()
        if op not in seen:
            phase = ("prefill" if calls[0] <= 1 else "decode") if lm else "forward"
            seen[op] = f"{phase}, {stack[-1] or '<root>' if stack else 'outside the model'}"

    try:
        with OpRecorder(note):
            tm.run(name, model, seed=3, **({"batch": 2, "prompt": 5, "steps": 2} if lm else {}))
    finally:
        for h in hooks:
            h.remove()
    return seen


def patched(name: str, release: str, fp8: str | None) -> tuple[torch.nn.Module, mpsboost.PatchReport]:
    model = tm.build(name, dtype="bfloat16" if name in LMS else "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # requested-but-skipped warnings: the rows say why
        report = mpsboost.patch(model, device=Env.simulate("mps", release), fp8=fp8)
    return model, report


CASES = [(r, n, None) for r in RELEASES for n in LMS + VAES] + [(r, n, "rowwise") for r in RELEASES for n in LMS]


@pytest.mark.parametrize("release,name,fp8", CASES, ids=[f"{r}-{n}-{f or 'default'}" for r, n, f in CASES])
def test_patched_model_dispatches_only_ops_the_wheel_has_kernels_for(release, name, fp8):
    model, report = patched(name, release, fp8)
    assert report.applied, f"no recipe applied to {name} under Mac {release} decisions: nothing was checked"
    seen = record(model, name)
    assert any(op.startswith("aten::") for op in seen)
    bad = unserved(seen, release)
    assert not bad, (
        f"{name} patched for Mac {release} ({', '.join(sorted({r.recipe for r in report.applied}))}) dispatches "
        f"ops the {release} macOS wheel has no MPS or composite kernel for: " + "; ".join(bad)
    )


def test_the_releases_checked_include_the_ones_the_gate_tells_apart():
    assert {"2.14.1", "2.15.0"} <= set(RELEASES)
    for v in RELEASES:
        (w,) = [w for w in TABLE_JSON["wheels"] if w["version"] == v]
        assert len(w["sha256"]) == 64  # the source wheel is named by its hash


def test_the_check_goes_red_for_an_op_the_release_lacks():
    """A layer that dispatches aten::take (its MPS kernel came with the 2.15.0 wheel, no composite before) is named
    under the 2.14.1 wheel and passes under 2.15.0; an op dropped from the table, a made-up op and an operator of
    another namespace without kernels are named too."""
    assert "take" in TABLE["2.15.0"]["mps"] and "take" not in served("2.14.1")
    model, _ = patched("qwen3_5_moe", "2.14.1", None)
    layer = model.get_submodule("model.layers.0.mlp")
    hook = layer.register_forward_hook(lambda m, a, o: torch.take(o, torch.zeros(1, dtype=torch.long)) and None)
    try:
        seen = record(model, "qwen3_5_moe")
    finally:
        hook.remove()
    assert seen["aten::take"].endswith("model.layers.0.mlp")
    late = unserved(seen, "2.14.1")
    assert late == [f"aten::take ({seen['aten::take']})"], late
    assert not unserved(seen, "2.15.0")
    # a table without aten::mm (a fake wheel): the matmuls of the run are named
    fake = {"2.14.1": {k: v - {"mm"} for k, v in TABLE["2.14.1"].items()}}
    assert "aten::mm" in seen and any(b.startswith("aten::mm (") for b in unserved(seen, "2.14.1", fake))
    assert unserved({"aten::no_such_op": "x"}, "2.15.0") == ["aten::no_such_op (x)"]
    assert "no MPS or composite kernel" in unserved({"mpsboost::no_such_op": "x"}, "2.15.0")[0]


def test_cpu_translations_are_cpu_only_kernels_and_their_mps_ops_exist():
    """:data:`ON_MPS_INSTEAD` may only translate an op that has no MPS kernel in any wheel read (a CPU choice),
    into ops that every release checked serves; otherwise it could hide a real gap."""
    for cpu_op, mps_ops in ON_MPS_INSTEAD.items():
        for v in TABLE:
            assert cpu_op not in TABLE[v]["mps"] and cpu_op not in TABLE[v]["composite"], (cpu_op, v)
        for v in RELEASES:
            assert set(mps_ops) <= served(v), (mps_ops, v)
    # the composite entry point that makes the choice
    assert all("scaled_dot_product_attention" in TABLE[v]["composite"] for v in RELEASES)
