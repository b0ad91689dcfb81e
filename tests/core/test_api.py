"""patch / unpatch / patched / plan machinery, exercised with test-only recipes."""

from __future__ import annotations

import threading
import types
from pathlib import Path

import pytest
from mpsboost.bench import relative_error
import torch
from torch import nn

import mpsboost
from mpsboost import patching, registry
from mpsboost.errors import (
    IrreversiblePatchError,
    NotPatchedError,
    PatchError,
    RecipeSkippedError,
    UnknownRecipeError,
    UnsupportedTargetError,
)
from mpsboost.gate import check
from mpsboost.registry import Decision, Recipe
from mpsboost.patching import Patch, bind_forward, original_forward

LINEAR = "torch.nn.modules.linear.Linear"


class _Scale(Recipe):
    """Multiplies each Linear's output by 2 (so the effect is visible)."""

    name = "t_scale"
    summary = "test: double Linear outputs"
    targets = (LINEAR,)
    default = False
    fail_at: int | None = None
    calls = 0

    def decide(self, match, env, options):
        return Decision.apply("times two", f"test on {env.device_type}")

    def apply(self, match, decision, env, options):
        type(self).calls += 1
        if self.fail_at is not None and type(self).calls == self.fail_at:
            raise RuntimeError("injected failure")

        def forward(mod, x):
            return 2 * original_forward(mod, "t_scale")(x)

        return bind_forward(match.module, self.name, forward)


class _NeedsMps215(Recipe):
    name = "t_gated"
    summary = "test: only where pad_constant_native passes"
    targets = (LINEAR,)
    default = False

    def decide(self, match, env, options):
        v = check("pad_constant_native", env)
        return Decision.apply("native pad", v.reason) if v.ok else Decision.skip(v.reason)

    def apply(self, match, decision, env, options):
        return bind_forward(match.module, self.name, lambda mod, x: original_forward(mod, "t_gated")(x))


class _Irreversible(Recipe):
    name = "t_irrev"
    summary = "test: converts a weight in place"
    targets = (LINEAR,)
    default = False
    lossless = False
    reversible = False

    def decide(self, match, env, options):
        return Decision.apply("in place", "test")

    def apply(self, match, decision, env, options):
        mod = match.module
        old = mod.weight
        mod.weight = nn.Parameter(old.detach().half().float())

        def undo():
            mod.weight = old

        return Patch(undo, reversible=False)

    def unpatch_hint(self):
        return "rebuild the test model"


@pytest.fixture
def recipes():
    _Scale.fail_at = None
    _Scale.calls = 0
    for cls in (_Scale, _NeedsMps215, _Irreversible):
        registry.register(cls)
    yield
    for cls in (_Scale, _NeedsMps215, _Irreversible):
        registry.unregister(cls.name)


def _model() -> nn.Module:
    # Bias-free linears and ReLU are positively homogeneous: doubling each linear scales the output by 8.
    return nn.Sequential(
        nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    )


def _snapshot(m: nn.Module) -> dict:
    """Every parameter/buffer value and every module's instance dict keys and forward."""
    return {
        "tensors": {k: v.detach().clone() for k, v in m.state_dict().items()},
        "dicts": {n: (sorted(mod.__dict__), mod.__dict__.get("forward")) for n, mod in m.named_modules()},
        "params": {n: id(p) for n, p in m.named_parameters()},
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["dicts"] == b["dicts"]
        and a["params"] == b["params"]
        and a["tensors"].keys() == b["tensors"].keys()
        and all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    )


def test_patch_changes_outputs_and_unpatch_restores_identity(recipes):
    m = _model()
    x = torch.randn(5, 8)
    ref = m(x)
    report = mpsboost.patch(m, recipes=["t_scale"])
    assert [r.target for r in report.applied] == ["0", "2.0", "2.1"]
    assert all(r.backing == "times two" for r in report.applied)
    assert "forward" in m[0].__dict__
    torch.testing.assert_close(m(x), ref * 8, rtol=1e-6, atol=1e-6)  # three linears, each doubled
    mpsboost.unpatch(m)
    for lin in (m[0], m[2][0], m[2][1]):
        assert "forward" not in lin.__dict__
        assert lin.forward.__func__ is nn.Linear.forward
        assert patching.ATTR not in lin.__dict__
    torch.testing.assert_close(m(x), ref, rtol=0, atol=0)


def test_unpatch_restores_a_preexisting_instance_forward(recipes):
    # accelerate's hooks put an instance forward in place; unpatch must give back that very object.
    m = _model()
    hook_fwd = types.MethodType(lambda self, x: nn.Linear.forward(self, x), m[0])
    m[0].forward = hook_fwd
    mpsboost.patch(m, recipes=["t_scale"])
    assert m[0].forward is not hook_fwd
    mpsboost.unpatch(m)
    assert m[0].__dict__["forward"] is hook_fwd


def test_rollback_on_third_target_leaves_module_exactly_as_before(recipes):
    m = _model()
    before = _snapshot(m)
    _Scale.fail_at = 3
    with pytest.raises(PatchError) as info:
        mpsboost.patch(m, recipes=["t_scale"])
    err = info.value
    assert err.recipe == "t_scale" and err.target == "2.1"
    assert "t_scale" in str(err) and "2.1" in str(err) and "undone" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert _same(before, _snapshot(m))
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(m)


@pytest.mark.parametrize("position", [1, 2, 3])
def test_rollback_at_every_position_across_two_recipes(recipes, position):
    # t_irrev runs on all three linears first (alphabetical at equal order), then t_scale fails.
    m = _model()
    before = _snapshot(m)
    _Scale.fail_at = position
    with pytest.raises(PatchError):
        mpsboost.patch(m, recipes=["t_irrev", "t_scale"])
    assert _same(before, _snapshot(m))


def test_patching_twice_is_a_reported_noop(recipes):
    m = _model()
    mpsboost.patch(m, recipes=["t_scale"])
    fwd = m[0].forward
    again = mpsboost.patch(m, recipes=["t_scale"])
    assert again.noop
    assert {r.status for r in again.rows} == {"already patched"}
    assert "already patched" in str(again)
    assert m[0].forward == fwd
    x = torch.randn(2, 8)
    mpsboost.unpatch(m)
    assert all("forward" not in l.__dict__ for l in m.modules() if isinstance(l, nn.Linear))
    assert torch.isfinite(m(x)).all()


def test_unpatch_of_unpatched_and_of_wrong_type():
    with pytest.raises(NotPatchedError, match="not patched"):
        mpsboost.unpatch(_model())
    with pytest.raises(UnsupportedTargetError, match="builtins.str"):
        mpsboost.unpatch("model")


@pytest.mark.parametrize("bad", [3, "pipe", None, [nn.Linear(2, 2)], {"a": nn.Linear(2, 2)}])
def test_wrong_object_types(bad):
    with pytest.raises(TypeError) as info:
        mpsboost.patch(bad)
    msg = str(info.value)
    assert type(bad).__name__ in msg and "DiffusionPipeline" in msg and "torch.nn.Module" in msg


def test_unknown_recipe_names_list_registered_and_closest(recipes):
    with pytest.raises(UnknownRecipeError) as info:
        mpsboost.patch(_model(), recipes=["t_scal"])
    msg = str(info.value)
    assert "'t_scale'" in msg and "t_gated" in msg
    with pytest.raises(UnknownRecipeError):
        mpsboost.patch(_model(), exclude=["nope"])
    with pytest.raises(TypeError, match="recipe names"):
        mpsboost.patch(_model(), recipes=[3])


def test_bad_arguments():
    with pytest.raises(ValueError, match="rowwise"):
        mpsboost.patch(_model(), fp8="int4")
    with pytest.raises(TypeError, match="strict"):
        mpsboost.patch(_model(), strict="yes")
    with pytest.raises(TypeError, match="device"):
        mpsboost.patch(_model(), device=3)


def test_context_manager_unpatches_on_exception(recipes):
    m = _model()
    x = torch.randn(3, 8)
    ref = m(x)
    with pytest.raises(ZeroDivisionError):
        with mpsboost.patched(m, recipes=["t_scale"]) as report:
            assert report.applied
            assert not torch.equal(m(x), ref)
            1 / 0
    assert all("forward" not in l.__dict__ for l in m.modules())
    torch.testing.assert_close(m(x), ref, rtol=0, atol=0)


def test_context_manager_keeps_earlier_patches(recipes):
    m = _model()
    mpsboost.patch(m, recipes=["t_gated"])
    with mpsboost.patched(m, recipes=["t_scale"]):
        assert patching.is_patched_by(m[0], "t_scale")
    assert not patching.is_patched_by(m[0], "t_scale")
    assert patching.is_patched_by(m[0], "t_gated")
    mpsboost.unpatch(m)
    assert "forward" not in m[0].__dict__


def test_plan_changes_nothing_and_simulates(recipes):
    m = _model()
    before = _snapshot(m)
    old = mpsboost.plan(m, recipes=["t_gated", "t_scale"], device="mps", torch_version="2.14.1")
    new = mpsboost.plan(m, recipes=["t_gated", "t_scale"], device="mps", torch_version="2.15.0")
    assert _same(before, _snapshot(m))
    assert old.mode == "plan" and old.env.simulated and old.env.device_type == "mps"
    gated_old = old.rows_for("t_gated")
    assert {r.status for r in gated_old} == {"skipped"} and "pytorch#195368" in gated_old[0].reason
    assert {r.status for r in new.rows_for("t_gated")} == {"would apply"}
    assert {r.status for r in old.rows_for("t_scale")} == {"would apply"}
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(m)


def test_plan_works_on_meta_models_and_patch_refuses_them(recipes):
    with torch.device("meta"):
        m = _model()
    report = mpsboost.plan(m, recipes=["t_scale"], device="mps", torch_version="2.15.0")
    assert len(report.applied) == 3
    with pytest.raises(UnsupportedTargetError, match="meta"):
        mpsboost.patch(m, recipes=["t_scale"])


def test_strict_turns_skips_into_errors_before_any_change(recipes):
    m = _model()
    before = _snapshot(m)
    with pytest.raises(RecipeSkippedError, match="t_gated"):
        mpsboost.patch(m, recipes=["t_scale", "t_gated"], strict=True, device=mpsboost.Env.simulate("mps", "2.14.1"))
    assert _same(before, _snapshot(m))


def test_strict_on_the_cpu_says_each_skipping_recipe_once_and_what_to_pass():
    """A default patch(strict=True) of a small real model on the CPU: one line per recipe that would skip (not
    one per layer: the message was 1,429 characters of repeated decode_linear rows), the targets counted, and
    the exclude list it offers is one that then patches without error."""
    import tiny_models

    m = tiny_models.build("qwen3").eval()
    plan = mpsboost.plan(m)
    skipping = sorted({r.recipe for r in plan.rows if r.status == "skipped"})
    before = _snapshot(m)
    with pytest.raises(RecipeSkippedError) as info:
        mpsboost.patch(m, strict=True)
    assert _same(before, _snapshot(m))
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0] == f"strict=True: {len(skipping)} selected recipes would be skipped on cpu; nothing was changed:"
    body = lines[1:-1]
    assert sorted(line.split()[0] for line in body) == skipping and all(len(line) <= 240 for line in body)
    n_linear = sum(1 for r in plan.rows if r.recipe == "decode_linear" and r.status == "skipped")
    assert n_linear > 1 and text.count("decode_linear") == 2  # its line and the exclude list
    assert f"decode_linear on {n_linear} targets, first " in text
    assert lines[-1].startswith(f"Pass exclude={skipping!r}, or drop strict=True")
    assert len(text) < 1200
    report = mpsboost.patch(m, strict=True, exclude=skipping)  # the advice works
    assert report.applied and not report.skipped
    mpsboost.unpatch(m)


def test_patching_again_for_another_environment_is_an_error_that_changes_nothing():
    """A model patched under Mac 2.14.1 decisions, then patch() under 2.15.0: an error (its layers would follow
    two environments' decisions at once), the model as the first call left it; the same environment again is the
    usual no-op; after unpatch the new environment patches. A model inside an already patched one counts too."""
    import tiny_models

    env_a, env_b = mpsboost.Env.simulate("mps", "2.14.1"), mpsboost.Env.simulate("mps", "2.15.0")
    m = tiny_models.build("qwen3").eval()
    first = mpsboost.patch(m, device=env_a)
    assert first.applied
    snap = _snapshot(m)
    with pytest.raises(PatchError, match=r"already patched for torch 2\.14\.1 on mps.*unpatch\(model\) first") as info:
        mpsboost.patch(m, device=env_b)
    assert "patch() for torch 2.15.0 on mps" in str(info.value)
    assert _same(snap, _snapshot(m)) and mpsboost.last_report(m) is first
    assert mpsboost.patch(m, device=env_a).noop
    mpsboost.unpatch(m)
    assert mpsboost.patch(m, device=env_b).applied
    mpsboost.unpatch(m)
    mpsboost.patch(m.model, device=env_a)  # the inner model, then the whole one under other decisions
    with pytest.raises(PatchError, match="a Qwen3Model inside this Qwen3ForCausalLM is already patched"):
        mpsboost.patch(m, device=env_b)
    mpsboost.unpatch(m)


def test_requested_skip_warns(recipes):
    m = _model()
    with pytest.warns(UserWarning, match="t_gated was skipped"):
        report = mpsboost.patch(m, recipes=["t_gated"], device=mpsboost.Env.simulate("mps", "2.14.1"))
    assert report.noop and report.skipped


def test_irreversible_unpatch_explains_and_changes_nothing(recipes):
    m = _model()
    mpsboost.patch(m, recipes=["t_scale", "t_irrev"])
    snap = _snapshot(m)
    with pytest.raises(IrreversiblePatchError) as info:
        mpsboost.unpatch(m)
    msg = str(info.value)
    assert "t_irrev" in msg and "rebuild the test model" in msg and "Nothing was changed" in msg
    assert _same(snap, _snapshot(m))


def test_report_reachable_and_serialisable(recipes):
    m = _model()
    report = mpsboost.patch(m, recipes=["t_scale"])
    assert mpsboost.last_report(m) is report
    d = report.to_dict()
    assert d["mode"] == "patch" and len(d["rows"]) == 3 and d["env"]["device_type"] == "cpu"
    import json

    assert json.loads(report.to_json())["rows"][0]["recipe"] == "t_scale"
    text = str(report)
    assert "t_scale" in text and "times two" in text and "3 targets" in text
    assert "1 recipe: 1 applied" in text and "Sequential: t_scale (3)" in text


def test_not_applicable_row_when_no_targets(recipes):
    m = nn.Sequential(nn.ReLU())
    report = mpsboost.plan(m, recipes=["t_scale"])
    assert [r.status for r in report.rows] == ["not applicable"]


def test_pipeline_components_are_reported_by_name(recipes):
    from diffusers import DiffusionPipeline

    class TinyPipe(DiffusionPipeline):
        def __init__(self, unet, text_encoder):
            super().__init__()
            self.register_modules(unet=unet, text_encoder=text_encoder)

    pipe = TinyPipe(_model(), nn.Linear(4, 4))
    report = mpsboost.patch(pipe, recipes=["t_scale"])
    assert sorted(r.target for r in report.applied) == ["text_encoder", "unet.0", "unet.2.0", "unet.2.1"]
    mpsboost.unpatch(pipe)
    assert "forward" not in pipe.text_encoder.__dict__

    empty = TinyPipe(None, None)
    with pytest.raises(UnsupportedTargetError, match="no torch.nn.Module"):
        mpsboost.patch(empty)


def test_patching_one_model_leaves_another_of_the_same_class_alone(recipes):
    a, b = _model(), _model()
    mpsboost.patch(a, recipes=["t_scale"])
    assert "forward" not in b[0].__dict__
    assert nn.Linear.forward is nn.Linear.__dict__["forward"]
    mpsboost.unpatch(a)


def test_two_threads_patching_are_serialised(recipes):
    m = _model()
    errors: list[BaseException] = []
    reports = []

    def work():
        try:
            reports.append(mpsboost.patch(m, recipes=["t_scale"]))
        except BaseException as e:  # collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(not r.noop for r in reports) == 1  # exactly one applied; the others saw it patched
    x = torch.randn(2, 8)
    ref = _model()
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), ref(x) * 8)
    mpsboost.unpatch(m)


def test_deepcopy_of_a_patched_model_unpatches_cleanly(recipes):
    import copy

    m = _model()
    mpsboost.patch(m, recipes=["t_scale"])
    twin = copy.deepcopy(m)
    x = torch.randn(2, 8)
    torch.testing.assert_close(twin(x), m(x))
    # The copy carries the patch state; undoing it through the registry helpers restores class forwards.
    for lin in (l for l in twin.modules() if isinstance(l, nn.Linear)):
        prev = lin.__dict__[patching.ATTR]["t_scale"]["forward"]
        assert prev is patching._MISSING
    mpsboost.unpatch(m)
    # A copy of a patched model: unpatch says what it is and changes nothing (its undo belongs to the original).
    from mpsboost.errors import PatchedCopyError

    twin2 = copy.deepcopy(_model())
    mpsboost.patch(twin2, recipes=["t_scale"])
    copied = copy.deepcopy(twin2)
    before = _snapshot(copied)
    with pytest.raises(PatchedCopyError, match=r"copy \(copy.deepcopy\) of a patched object.*Nothing was changed"):
        mpsboost.unpatch(copied)
    assert _same(before, _snapshot(copied))
    mpsboost.unpatch(twin2)
    with pytest.raises(NotPatchedError, match="not patched") as info:  # a copy of an unpatched model: plain
        mpsboost.unpatch(copy.deepcopy(twin2))
    assert not isinstance(info.value, PatchedCopyError)


def test_unpatch_and_plan_name_their_own_action():
    with pytest.raises(UnsupportedTargetError, match=r"cannot unpatch a builtins.str"):
        mpsboost.unpatch("x")
    with pytest.raises(UnsupportedTargetError, match=r"cannot plan for a builtins.int"):
        mpsboost.plan(3)


@pytest.mark.parametrize("device", ["tpu", "xla:0", torch.device("meta")])
def test_unknown_device_gets_one_line_listing_what_is_known(device):
    from mpsboost.errors import GateError

    with pytest.raises(GateError) as info:
        mpsboost.patch(_model(), device=device)
    msg = str(info.value)
    assert "\n" not in msg and "accepted: cpu, cuda, mps" in msg and str(device) in msg
    with pytest.raises(GateError, match="accepted: cpu, cuda, mps"):
        mpsboost.plan(_model(), device="tpu", torch_version="2.15.0")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS (the simulated path)")
def test_an_absent_device_is_simulated_warned_and_marked(recipes):
    m = _model()
    with pytest.warns(UserWarning, match="torch sees no mps device here; the decisions are simulated"):
        report = mpsboost.patch(m, recipes=["t_scale"], device="mps")
    assert report.env.simulated and report.env.device_type == "mps"
    assert str(report).splitlines()[0].count("simulated") >= 1
    assert report.to_dict()["env"]["simulated"] is True
    mpsboost.unpatch(m)


def test_report_folds_rows_with_one_reason_into_one_line(recipes):
    # 12 layers of 3 linears: every row has the same recipe, status and reason -> one line with a count
    m = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(12)])
    report = mpsboost.plan(m, recipes=["t_gated"], device="mps", torch_version="2.14.1")
    assert len(report.rows) == 36 and all(r.status == "skipped" for r in report.rows)
    lines = str(report).splitlines()
    body = [ln for ln in lines if ln.startswith("t_gated")]
    assert len(body) == 1, lines
    assert "36 targets" in body[0] and "(12 paths)" in body[0]
    assert str(report).count("needs torch 2.15") == 1
    assert len(report.to_dict()["rows"]) == 36  # the JSON keeps every row


def test_fp8_io_names_its_own_action_for_a_wrong_object(tmp_path):
    with pytest.raises(UnsupportedTargetError, match=r"cannot save or load fp8 weights of a builtins.NoneType"):
        mpsboost.save_fp8(None, tmp_path / "x.safetensors")


def test_unpatch_after_a_patch_that_applied_nothing_is_a_quiet_noop(recipes):
    # Every row skipped (the gate fails on simulated MPS 2.14.1): patch() was called, last_report() has
    # its report, and `try: patch ... finally: unpatch` must work.
    m = _model()
    before = _snapshot(m)
    try:
        report = mpsboost.patch(m, recipes=["t_gated"], device=mpsboost.Env.simulate("mps", "2.14.1"))
        assert report.noop and {r.status for r in report.rows} == {"skipped"}
        assert mpsboost.last_report(m) is report
    finally:
        mpsboost.unpatch(m)  # no NotPatchedError
    assert _same(before, _snapshot(m))
    # The records are gone: a second unpatch, like one on an object never passed to patch(), raises.
    with pytest.raises(NotPatchedError, match="not patched"):
        mpsboost.unpatch(m)
    with pytest.raises(NotPatchedError, match="not patched"):
        mpsboost.unpatch(_model())


def test_unpatch_after_a_noop_patch_of_a_dense_lm_on_cuda():
    # A patch that applies nothing: a dense Qwen3 with CUDA decisions, rms_norm left out (it applies there in
    # eager mode since the 2026-12-01 H200 measurement; every other default recipe steps aside).
    pytest.importorskip("transformers")
    import tiny_models as tm

    m = tm.build("qwen3")
    report = mpsboost.patch(m, device=mpsboost.Env.simulate("cuda:9.0"), exclude=["rms_norm"])
    assert report.noop, str(report)
    mpsboost.unpatch(m)
    assert not any(mod.__dict__.get(patching.ATTR) for mod in m.modules())
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(m)


def test_unpatch_after_patch_then_noop_repatch_undoes_the_first(recipes):
    m = _model()
    mpsboost.patch(m, recipes=["t_scale"])
    assert mpsboost.patch(m, recipes=["t_scale"]).noop
    mpsboost.unpatch(m)
    assert all("forward" not in lin.__dict__ for lin in m.modules() if isinstance(lin, nn.Linear))


# ------------------------------------------------------------------------------------------ typed plans


def test_a_typed_plan_reaches_apply_and_the_report_shows_its_reported_fields():
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Found:
        out_features: int

    @dataclass(frozen=True)
    class Plan:
        factor: int
        seen: int
        note: str = field(default="internal", metadata=registry.NOT_REPORTED)

    applied = []

    class Typed(Recipe):
        name = "t_typed"
        targets = (LINEAR,)
        default = False

        def find(self, root, prefix=""):
            for m in super().find(root, prefix):
                yield registry.Match(m.module, m.path, Found(m.module.out_features))

        def decide(self, match, env, options):
            return Decision.apply(
                "times factor", "test", plan=Plan(factor=3, seen=match.data.out_features), extra="kept"
            )

        def apply(self, match, decision, env, options):
            applied.append(decision.plan)
            factor = decision.plan.factor
            return bind_forward(match.module, self.name, lambda mod, x: factor * original_forward(mod, "t_typed")(x))

    registry.register(Typed)
    try:
        lin = nn.Linear(4, 5)
        x = torch.randn(3, 4)
        ref = lin(x)
        report = mpsboost.patch(lin, recipes=["t_typed"])
        assert applied == [Plan(factor=3, seen=5)]
        # The plan's fields in declaration order, without the unreported one, then the explicit keywords.
        assert list(report.rows[0].details.items()) == [("factor", 3), ("seen", 5), ("extra", "kept")]
        assert report.to_dict()["rows"][0]["details"] == {"factor": 3, "seen": 5, "extra": "kept"}
        torch.testing.assert_close(lin(x), 3 * ref)
        mpsboost.unpatch(lin)
        torch.testing.assert_close(lin(x), ref, rtol=0, atol=0)
    finally:
        registry.unregister("t_typed")


def test_plan_details_takes_a_plan_own_report_and_refuses_what_is_not_a_plan():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Custom:
        a: int
        b: int | None = None

        def report_details(self):
            return {"a": self.a} if self.b is None else {"b": self.b, "a": self.a}

    assert Decision.apply("x", "y", plan=Custom(1)).details == {"a": 1}
    assert list(Decision.apply("x", "y", plan=Custom(1, 2)).details) == ["b", "a"]
    assert Decision.skip("why", plan=Custom(4)).details == {"a": 4}
    assert Decision.apply("x", "y", k=1).details == {"k": 1} and Decision.apply("x", "y").plan is None
    with pytest.raises(TypeError, match="frozen dataclass instance.*got dict"):
        Decision.apply("x", "y", plan={"factor": 3})
    with pytest.raises(TypeError, match="got type"):
        Decision.apply("x", "y", plan=Custom)  # the class, not an instance


# ------------------------------------------------------------------ nested models: an inner and its outer model


def _nested_cases():
    return [
        pytest.param("qwen3_5_moe", lambda m: m.model, id="qwen3_5_moe-lm.model"),
        pytest.param("llama_eager", lambda m: m.model, id="llama_eager-lm.model"),
        pytest.param("wan22_ti2v_pipeline", lambda p: p.transformer, id="wan22_pipeline-transformer"),
    ]


def _marks(obj) -> set:
    import tiny_models as tm

    return {
        (prefix, name, key)
        for prefix, root in tm.modules_of(obj)
        for name, mod in root.named_modules()
        for key in mod.__dict__.get(patching.ATTR, {})
    }


@pytest.mark.parametrize("model,inner", _nested_cases())
@pytest.mark.parametrize("version", ["2.14.1", "2.15.0"])
def test_patching_an_inner_model_then_its_outer_model(model, inner, version):
    """patch(lm.model) then patch(lm): the second call reports what the first changed as already patched and
    patches the rest (no module gets one recipe twice); unpatch(lm.model) undoes the first call only,
    unpatch(lm) every call made on lm and inside it; the model is then exactly as built."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    import tiny_models as tm
    from mpsboost.gate import Env

    mac = Env.simulate("mps", version)
    obj = tm.build(model)
    before = tm.snapshot(obj)
    first = mpsboost.patch(inner(obj), device=mac)
    second = mpsboost.patch(obj, device=mac)
    assert first.applied, first
    assert second.by_status("already patched"), second
    # every module change the inner call made is still there, once
    inner_marks = {(n, k) for _, n, k in _marks(inner(obj))}
    assert inner_marks
    mpsboost.unpatch(inner(obj))  # the inner call's changes only
    assert not ({(n, k) for _, n, k in _marks(inner(obj))} & inner_marks)
    mpsboost.unpatch(obj)
    assert tm.diff_snapshot(before, tm.snapshot(obj)) == []
    # the same again, then unpatch the outer object alone: it undoes the inner call too (newest first)
    mpsboost.patch(inner(obj), device=mac)
    mpsboost.patch(obj, device=mac)
    mpsboost.unpatch(obj)
    assert tm.diff_snapshot(before, tm.snapshot(obj)) == []
    assert not _marks(obj)
    with pytest.raises(NotPatchedError):
        mpsboost.unpatch(inner(obj))


@pytest.mark.parametrize("model,inner", _nested_cases())
@pytest.mark.parametrize("version", ["2.14.1", "2.15.0"])
def test_patching_an_outer_model_then_an_inner_one(model, inner, version):
    """patch(lm) then patch(lm.model): a no-op reported as already patched; the marks are those of one
    patch(lm); unpatch(lm.model) is a quiet no-op that leaves lm patched, unpatch(lm) restores everything.
    A module inside a patched model that no patch() was called on: unpatch names the enclosing object."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    import tiny_models as tm
    from mpsboost.errors import PatchedCopyError
    from mpsboost.gate import Env

    mac = Env.simulate("mps", version)
    obj = tm.build(model)
    before = tm.snapshot(obj)
    mpsboost.patch(obj, device=mac)
    marks = _marks(obj)
    with pytest.raises(PatchedCopyError, match="enclosing model or pipeline"):
        mpsboost.unpatch(inner(obj))
    again = mpsboost.patch(inner(obj), device=mac)
    assert again.noop and again.by_status("already patched"), again
    assert _marks(obj) == marks
    mpsboost.unpatch(inner(obj))  # nothing of it was this call's
    assert _marks(obj) == marks and mpsboost.api.is_patched(obj)
    mpsboost.unpatch(obj)
    assert tm.diff_snapshot(before, tm.snapshot(obj)) == []


def test_inner_then_outer_computes_like_stock():
    """The nested patches together compute what the stock model computes (fresh inputs, Mac 2.14.1
    decisions run on the CPU; fp32, 1e-4 relative)."""
    pytest.importorskip("transformers")
    import tiny_models as tm
    from mpsboost.gate import Env

    mac = Env.simulate("mps", "2.14.1")
    stock = tm.build("qwen3_5_moe")
    model = tm.clone(stock)
    mpsboost.patch(model.model, device=mac)
    mpsboost.patch(model, device=mac)
    for seed in (1, 2):
        assert relative_error(tm.run("qwen3_5_moe", model, seed), tm.run("qwen3_5_moe", stock, seed)) < 1e-4


# ------------------------------------------------------------------ device= and options= read the same everywhere


def test_plan_takes_an_env_as_device_like_patch(recipes):
    from mpsboost.gate import Env

    mac = Env.simulate("mps", "2.14.1")
    m = _model()
    by_device = mpsboost.plan(m, recipes=["t_gated"], device=mac)
    by_env = mpsboost.plan(m, recipes=["t_gated"], env=mac)
    assert by_device.env == mac and by_device.to_json() == by_env.to_json()
    patched_report = mpsboost.patch(m, recipes=["t_gated"], device=mac)
    assert [r.status for r in patched_report.rows] == [r.status for r in by_device.rows]
    with pytest.raises(TypeError, match="an mpsboost.Env already"):
        mpsboost.plan(m, device=mac, torch_version="2.15.0")
    # a torch.device works too (simulated, as a name does in plan)
    assert mpsboost.plan(m, recipes=["t_gated"], device=torch.device("mps")).env.device_type == "mps"


def test_an_absent_device_is_one_line_for_load_fp8_as_for_patch(tmp_path, monkeypatch):
    """patch(device="mps") without MPS simulates and warns; load_fp8, which must put tensors there, raises
    the same sentence as one GateError line (not a file error)."""
    pytest.importorskip("transformers")
    import tiny_models as tm
    from mpsboost.errors import GateError

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    src = tm.build("qwen3_moe", dtype="bfloat16")
    with pytest.warns(UserWarning, match="torch sees no mps device here") as seen:
        mpsboost.patch(src, fp8="rowwise", device="mps")
    sentence = "device='mps' but torch sees no mps device here"
    assert sentence in str(seen[0].message)
    mpsboost.save_fp8(src, tmp_path / "ck")
    target = tm.build("qwen3_moe", dtype="bfloat16", seed=1)
    with pytest.raises(GateError) as info:
        mpsboost.load_fp8(target, tmp_path / "ck", device="mps")
    assert sentence in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(GateError, match="not one mpsboost knows"):
        mpsboost.load_fp8(target, tmp_path / "ck", device="tpu")


def test_options_for_a_recipe_not_selected_raise(recipes):
    from mpsboost.errors import RecipeOptionError

    m = _model()
    with pytest.raises(RecipeOptionError, match=r"options name softmax, which this call does not select"):
        mpsboost.patch(m, recipes=["t_scale"], options={"softmax": {"path": "logits"}})
    with pytest.raises(RecipeOptionError, match=r"does not select .*select it"):
        mpsboost.plan(m, exclude=["softmax"], options={"softmax": {"path": "logits"}})
    with pytest.raises(RecipeOptionError, match=r"select it with fp8="):
        mpsboost.patch(m, options={"fp8_weights": {"include": ["x"]}})
    assert not mpsboost.api.is_patched(m)
    # selected: accepted (softmax finds no target in this model: the row says so)
    report = mpsboost.plan(m, recipes=["t_scale", "softmax"], options={"softmax": {"path": "logits"}})
    assert report.rows_for("softmax")


def test_mac_compile_is_exported_at_the_top_level():
    from mpsboost.recipes import linear_attention

    assert mpsboost.mac_compile is linear_attention.mac_compile
    assert "mac_compile" in mpsboost.__all__ and "mac_compile" in dir(mpsboost)
    assert "mpsboost.mac_compile(model)" in (Path(__file__).resolve().parents[2] / "README.md").read_text()
