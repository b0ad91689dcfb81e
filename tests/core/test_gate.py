"""The version gate: parsing every version form, and verdicts for simulated environments."""

from __future__ import annotations

import datetime as dt

import pytest

from mpsboost import gate
from mpsboost.errors import GateError
from mpsboost.gate import Env, Feature, Rule, check, check_all, matrix, parse_torch_version


@pytest.mark.parametrize(
    "text, release, kind, date, local",
    [
        ("2.15.0", (2, 15, 0), "release", None, None),
        ("2.15", (2, 15, 0), "release", None, None),
        ("2.15.0+cpu", (2, 15, 0), "release", None, "cpu"),
        ("2.15.0+cu130", (2, 15, 0), "release", None, "cu130"),
        ("2.15.0a0+gitabc1234", (2, 15, 0), "source", None, "gitabc1234"),
        ("2.16.0.dev20261101", (2, 16, 0), "nightly", dt.date(2026, 11, 1), None),
        ("2.16.0.dev20261101+cpu", (2, 16, 0), "nightly", dt.date(2026, 11, 1), "cpu"),
        ("2.14.1", (2, 14, 1), "release", None, None),
        ("2.15.0rc1", (2, 15, 0), "prerelease", None, None),
    ],
)
def test_parse_every_form(text, release, kind, date, local):
    v = parse_torch_version(text)
    assert v.release == release
    assert v.kind == kind
    assert v.nightly_date == date
    assert v.local == local
    assert v.raw == text


@pytest.mark.parametrize("bad", ["", "banana", "2", "0.x", "2.16.0.dev20261399", "v2..1"])
def test_nonsense_versions_raise_clear_error(bad):
    with pytest.raises(GateError, match=r"torch version|impossible date|not a torch version"):
        parse_torch_version(bad)


def test_non_string_version_is_type_error():
    with pytest.raises(TypeError, match="str"):
        parse_torch_version(2.15)  # type: ignore[arg-type]


def test_pep440_trap_nightly_counts_as_its_own_minor():
    # packaging sorts 2.16.0.dev below 2.16.0, but a 2.16 nightly has every 2.15 feature.
    env = Env.simulate("mps", "2.16.0.dev20261101")
    assert check("grouped_mm", env).ok
    assert check("pad_constant_native", env).ok


@pytest.mark.parametrize(
    "version, ok",
    [
        ("2.14.1", False),
        ("2.15.0", True),
        ("2.15.0a0+gitabc1234", True),
        ("2.15.0+cpu", True),
        ("2.16.0.dev20261101", True),
        ("2.13.0", False),
    ],
)
def test_mps_215_features(version, ok):
    env = Env.simulate("mps", version)
    for feat in (
        "pad_constant_native",
        "pad_rank5_correct",
        "grouped_mm",
        "float8_storage",
        "scaled_mm",
        "linear_3d_fast",
        "softmax_native",
        "sdpa_broadcast",
        # the 2.15.0 macOS wheel's kernels: triangular_solve_small_*, scaled_mm_few_rows_*, histc_atomic_*
        "solve_triangular_fast",
        "fp8_gemv",
        "histc_int",
        "histc_no_host_sync",
        "device_streams",
    ):
        v = check(feat, env)
        assert v.ok is ok, (feat, version, v.reason)
        if not ok:
            assert "2.15" in v.reason and version in v.reason
            assert "pytorch#" in v.reason or "#" in v.reason


def test_mps_reason_names_the_upstream_change():
    v = check("pad_constant_native", Env.simulate("mps", "2.14.1"))
    assert not v.ok and "pytorch#195368" in v.reason
    v = check("pad_rank5_correct", Env.simulate("mps", "2.14.1"))
    assert "194922" in v.reason


def test_nightly_only_features_on_215_and_216():
    for feat in ("cross_stream_events", "metal_attention"):
        assert not check(feat, Env.simulate("mps", "2.15.0")).ok
        assert "2.16" in check(feat, Env.simulate("mps", "2.15.0")).reason
        assert check(feat, Env.simulate("mps", "2.16.0")).ok


def test_nightly_merge_date(monkeypatch):
    merged = dt.date(2026, 10, 15)
    feat = Feature(
        "test_feature",
        "a test feature",
        {"mps": (Rule(since="2.16", nightly_only=True, merged=merged, upstream="pytorch#1"),)},
    )
    monkeypatch.setitem(gate.FEATURES, "test_feature", feat)
    before = check("test_feature", Env.simulate("mps", "2.16.0.dev20261014"))
    on = check("test_feature", Env.simulate("mps", "2.16.0.dev20261015"))
    after = check("test_feature", Env.simulate("mps", "2.16.0.dev20261101"))
    later_minor = check("test_feature", Env.simulate("mps", "2.17.0.dev20260101"))
    assert not before.ok and "predates" in before.reason and "pytorch#1" in before.reason
    assert on.ok and after.ok
    assert later_minor.ok  # a 2.17 nightly has everything merged for 2.16
    assert not check("test_feature", Env.simulate("mps", "2.15.0")).ok


def test_cuda_capabilities():
    sm80 = Env.simulate("cuda:8.0", "2.11.0+cu130")
    sm90 = Env.simulate("cuda:9.0", "2.11.0+cu130")
    sm89 = Env.simulate("cuda", "2.11.0", capability=(8, 9))
    assert sm80.capability == (8, 0) and sm90.capability == (9, 0)
    assert not check("scaled_mm", sm80).ok and "8.9" in check("scaled_mm", sm80).reason
    assert check("scaled_mm", sm89).ok and check("scaled_mm", sm90).ok
    assert check("grouped_mm", sm90).ok
    assert check("grouped_mm", sm80).ok  # >= 2.9 on sm80
    assert not check("grouped_mm", Env.simulate("cuda:8.0", "2.8.0")).ok
    assert check("grouped_mm", Env.simulate("cuda:9.0", "2.8.0")).ok
    assert not check("grouped_mm", Env.simulate("cuda:7.5", "2.11.0")).ok


def test_cpu_verdicts():
    cpu = Env.simulate("cpu", "2.13.0+cpu")
    assert check("grouped_mm", cpu).ok
    assert not check("grouped_mm", Env.simulate("cpu", "2.9.0")).ok
    assert not check("scaled_mm", cpu).ok
    assert not check("device_streams", cpu).ok
    assert not check("histc_int", cpu).ok
    assert check("float8_storage", cpu).ok


def test_unknown_feature_and_bad_env():
    env = Env.simulate("cpu", "2.13.0")
    with pytest.raises(GateError, match="did you mean 'grouped_mm'"):
        check("grouped_m", env)
    with pytest.raises(TypeError, match="Env"):
        check("grouped_mm", "mps")  # type: ignore[arg-type]
    with pytest.raises(GateError, match="device type"):
        Env(torch_version=parse_torch_version("2.15.0"), device_type="tpu")
    with pytest.raises(GateError, match="cuda:9.0"):
        Env.simulate("cuda:nine", "2.15.0")


def test_check_all_and_matrix():
    env = Env.simulate("mps", "2.14.1")
    v = check_all(("float8_storage", "grouped_mm"), env)
    assert not v.ok and "float8" in v.reason
    assert check_all((), env).ok
    m = matrix(env)
    assert set(m) == set(gate.FEATURES)
    assert all(isinstance(x.reason, str) and x.reason for x in m.values())


def test_detect_reads_the_real_build():
    import torch

    env = Env.detect("cpu")
    assert env.device_type == "cpu" and not env.simulated
    assert env.torch_version.raw == torch.__version__.split(" ")[0]
    if not torch.cuda.is_available():
        with pytest.raises(GateError, match="cuda"):
            Env.detect("cuda")


# ------------------------------------------------------------------------- each entry, either side

# (feature, device, a build without it, a build with it, text the failing reason must name)
EITHER_SIDE = [
    ("pad_constant_native", "mps", "2.14.1", "2.15.0", "pytorch#195368"),
    ("pad_rank5_correct", "mps", "2.14.1", "2.15.0", "194922"),
    ("pad3d_all_modes_correct", "mps", "2.14.1", "2.15.0", "pytorch#195147"),
    ("grouped_mm", "mps", "2.14.1", "2.15.0", "pytorch#194917"),
    ("grouped_mm", "cpu", "2.9.1", "2.10.0", "grouped_mm"),
    ("float8_storage", "mps", "2.14.1", "2.15.0", "pytorch#194074"),
    ("scaled_mm", "mps", "2.14.1", "2.15.0", "pytorch#196916"),
    ("gemv_bias_epilogue", "mps", "2.13.0", "2.14.0", "pytorch#186927"),  # kernels gemv_*_ab in the 2.14.0 wheel
    ("linear_3d_fast", "mps", "2.14.1", "2.15.0", "pytorch#189855"),
    ("softmax_native", "mps", "2.14.1", "2.15.0", "pytorch#196071"),
    ("sdpa_broadcast", "mps", "2.14.1", "2.15.0", "pytorch#189631"),
    ("histc_no_host_sync", "mps", "2.14.1", "2.15.0", "pytorch#196016"),
    ("conv3d_metal", "mps", "2.13.1", "2.14.0", "pytorch#188802"),
    ("sdpa_metal_macos26_fixed", "mps", "2.13.1", "2.14.0", "pytorch#191794"),
    ("sdpa_metal_prefill", "mps", "2.12.1", "2.13.0", "pytorch#181575"),
    ("sdpa_metal_gqa", "mps", "2.12.1", "2.13.0", "pytorch#183280"),
    ("sdpa_metal_gqa", "cpu", "2.4.1", "2.5.0", "enable_gqa"),
    ("sdpa_mpp_attention", "mps", "2.13.0", "2.14.0", "pytorch#182256"),  # prefill_attention_mpp_* from 2.14.0
    ("device_streams", "mps", "2.14.1", "2.15.0", "pytorch#191415"),
    ("cross_stream_events", "mps", "2.15.0", "2.16.0.dev20261101", "pytorch#194111"),
    ("solve_triangular_fast", "mps", "2.14.1", "2.15.0", "triangular_solve_small_16"),
    ("fp8_gemv", "mps", "2.14.1", "2.15.0", "scaled_mm_few_rows_1_float8_e4m3fn"),
    ("histc_int", "mps", "2.14.1", "2.15.0", "histc_atomic_global_int"),
    ("metal_attention", "mps", "2.15.0", "2.16.0.dev20261101", "main branch"),
    ("scaled_mm", "cuda", "2.3.1", "2.4.0", "torch._scaled_mm"),
]


@pytest.mark.parametrize("feature, device, without, with_, cite", EITHER_SIDE)
def test_each_entry_either_side(feature, device, without, with_, cite):
    no = check(feature, Env.simulate(device, without))
    yes = check(feature, Env.simulate(device, with_))
    assert not no.ok and cite in no.reason and without in no.reason, no.reason
    assert yes.ok, yes.reason
    assert no.decided_by == yes.decided_by == "by version"  # simulated: the version rule decides


# (feature, nightly of the first version before the merge, nightly of the merge day)
MERGE_DATES = [
    ("sdpa_metal_gqa", "2.13.0.dev20260510", "2.13.0.dev20260511", "2026-05-11"),
    ("sdpa_metal_macos26_fixed", "2.14.0.dev20260801", "2.14.0.dev20260802", "2026-08-02"),
]


@pytest.mark.parametrize("feature, before, on, date", MERGE_DATES)
def test_nightlies_either_side_of_the_merge(feature, before, on, date):
    b = check(feature, Env.simulate("mps", before))
    assert not b.ok and "predates the merge" in b.reason and date in b.reason
    assert check(feature, Env.simulate("mps", on)).ok


@pytest.mark.parametrize("feature", ["sdpa_large_scores_correct"])
def test_unfixed_entries_fail_on_every_mps_build(feature):
    for tv in (
        "2.12.0",
        "2.13.0",
        "2.14.1",
        "2.15.0",
        "2.15.0a0+gitabc1234",
        "2.16.0.dev20261130",
        "2.17.0.dev20270101",
    ):
        v = check(feature, Env.simulate("mps", tv))
        assert not v.ok and "not in any torch build" in v.reason, (feature, tv)


def test_large_scores_entry_says_not_fixed_and_how_to_split():
    v = check("sdpa_large_scores_correct", Env.simulate("mps", "2.15.0"))
    assert "not fixed as of 2026-11-30" in v.reason and "2^31" in v.reason
    assert "179352" in v.reason and "ComfyUI#14837" in v.reason
    assert check("sdpa_large_scores_correct", Env.simulate("cuda:9.0", "2.11.0")).ok
    assert check("sdpa_large_scores_correct", Env.simulate("cpu", "2.13.0")).ok
    import torch

    from mpsboost.ops.attention_split import score_elements
    from mpsboost.recipes.attention_split import MAX_SCORES

    assert MAX_SCORES == 2**31
    assert score_elements(torch.empty(2, 8, 5, 4), torch.empty(2, 2, 7, 4)) == 2 * 8 * 5 * 7


def test_conv3d_reason_is_about_throughput_numbers_from_the_issue():
    v = check("conv3d_metal", Env.simulate("mps", "2.14.0"))
    assert "#192213" in v.reason and "7%" in v.reason and "97%" in v.reason


def test_macos_condition():
    old = Env.simulate("mps", "2.15.0", macos="26.1")
    new = Env.simulate("mps", "2.15.0", macos="26.2")
    unknown = Env.simulate("mps", "2.15.0")
    v = check("sdpa_mpp_attention", old)
    assert not v.ok and "macOS >= 26.2" in v.reason and "26.1" in v.reason
    assert check("sdpa_mpp_attention", new).ok
    u = check("sdpa_mpp_attention", unknown)
    assert u.ok and "assumed" in u.reason
    assert "fp16/bf16" in u.reason and "64/96/128/256" in u.reason
    with pytest.raises(GateError, match="macOS version"):
        Env.simulate("mps", "2.15.0", macos="twenty-six")


def test_feature_info_for_doctor():
    info = gate.feature_info("sdpa_metal_gqa", "mps")
    (rule,) = info["rules"]
    assert (
        rule["upstream"].startswith("pytorch#183280")
        and rule["merged"] == "2026-05-11"
        and rule["first_release"] == "2.13.0"
    )
    assert info["probe"] is True
    assert rule["evidence"] == gate.BEHAVIOURAL
    (streams,) = gate.feature_info("device_streams", "mps")["rules"]
    assert streams["first_release"] == "2.15.0" and streams["evidence"] == "mps_streams"
    (events,) = gate.feature_info("cross_stream_events", "mps")["rules"]
    assert events["first_release"].startswith("none yet")
    (never,) = gate.feature_info("sdpa_large_scores_correct", "mps")["rules"]
    assert never["first_release"].startswith("none")
    assert gate.feature_info("sdpa_metal_prefill", "cpu")["rules"] == []
    with pytest.raises(GateError, match="unknown feature"):
        gate.feature_info("nope", "mps")


# ------------------------------------------------------------------------- probes


def _real_mps(version: str) -> Env:
    """A not-simulated MPS environment (what Env.detect gives on a Mac), for fake probes."""
    return Env(torch_version=parse_torch_version(version), device_type="mps", device_name="fake Mac", simulated=False)


@pytest.fixture
def fresh_probes():
    gate.clear_probe_cache()
    yield
    gate.clear_probe_cache()


def _with_probe(monkeypatch, name, probe):
    feat = gate.FEATURES[name]
    monkeypatch.setitem(
        gate.FEATURES, name, Feature(feat.name, feat.description, feat.rules, probe, feat.probe_decides)
    )


def test_probe_vetoes_a_nightly_the_table_lets_through(monkeypatch, fresh_probes):
    """A 2.16 nightly without torch.mps.Stream: the table says yes, the device says no."""
    calls = []

    def no_streams(env):
        calls.append(env.device_type)
        return gate.Verdict(False, "this torch build has no torch.mps.Stream (pytorch#191415 not in it)")

    _with_probe(monkeypatch, "device_streams", no_streams)
    env = _real_mps("2.16.0.dev20261101")
    v = check("device_streams", env)
    assert not v.ok and v.decided_by == "probed" and "torch.mps.Stream" in v.reason and "probed on mps" in v.reason
    assert check("device_streams", env) == v
    assert calls == ["mps"]  # once per process
    # a simulated environment takes the version rule's word and never probes
    sim = check("device_streams", Env.simulate("mps", "2.16.0.dev20261101"))
    assert sim.ok and sim.decided_by == "by version" and "by version" in sim.reason and calls == ["mps"]


def test_a_veto_only_probe_does_not_run_where_the_version_refuses(monkeypatch, fresh_probes):
    calls = []
    _with_probe(monkeypatch, "grouped_mm", lambda env: calls.append(1))
    v = check("grouped_mm", _real_mps("2.14.1"))
    assert not v.ok and v.decided_by == "by version" and calls == []


def test_probe_confirms_and_says_so(monkeypatch, fresh_probes):
    _with_probe(monkeypatch, "grouped_mm", lambda env: None)
    v = check("grouped_mm", _real_mps("2.15.0"))
    assert v.ok and v.decided_by == "probed" and "probed on mps: confirmed" in v.reason


def test_probe_that_raises_is_a_missing_feature(monkeypatch, fresh_probes):
    def broken(env):
        raise RuntimeError("Trying to convert Float8_e4m3fn to the MPS backend")

    _with_probe(monkeypatch, "float8_storage", broken)
    v = check("float8_storage", _real_mps("2.15.0"))
    assert not v.ok and v.decided_by == "probed" and "Float8_e4m3fn" in v.reason and "probe failed" in v.reason


def test_probe_never_runs_inside_traced_code(monkeypatch, fresh_probes):
    import torch

    calls = []
    _with_probe(monkeypatch, "sdpa_metal_gqa", lambda env: calls.append(1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    v = check("sdpa_metal_gqa", _real_mps("2.15.0"))
    assert v.ok and v.decided_by == "by version" and "deferred" in v.reason and calls == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert check("sdpa_metal_gqa", _real_mps("2.15.0")).decided_by == "probed" and calls == [1]


@pytest.mark.parametrize("feature", ["device_streams", "grouped_mm", "float8_storage", "sdpa_metal_gqa"])
def test_api_and_dtype_features_have_probes(feature):
    assert gate.FEATURES[feature].probe is not None


@pytest.mark.parametrize("feature", ["grouped_mm", "float8_storage", "sdpa_metal_gqa"])
def test_real_probes_run_on_this_cpu(feature, fresh_probes):
    """The probe functions themselves are device-generic: on the CPU they run for real."""
    v = check(feature, Env.detect("cpu"))
    assert v.ok and v.decided_by == "probed", v.reason


class _FakeMpsStream:
    """What torch.mps.Stream (pytorch#191415) gives: a stream other than the current one."""


@pytest.mark.parametrize("version", ["2.15.0", "2.16.0.dev20261101", "2.14.1"])
def test_streams_probed_when_torch_mps_stream_exists(monkeypatch, fresh_probes, version):
    """The build has torch.mps.Stream: streams are on, decided by the probe, whatever the version says."""
    import torch

    monkeypatch.setattr(torch.mps, "Stream", _FakeMpsStream, raising=False)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: object())
    v = check("device_streams", _real_mps(version))
    assert v.ok and v.decided_by == "probed" and "probed on mps" in v.reason, v.reason
    if version == "2.14.1":
        assert "present in this build" in v.reason and "by version alone" in v.reason
    # where no probe is possible (a simulated environment) the version rule decides, and says so
    sim = check("device_streams", Env.simulate("mps", version))
    assert sim.decided_by == "by version" and "by version" in sim.reason
    assert sim.ok is (version != "2.14.1")  # torch/mps/streams.py ships from the 2.15.0 macOS wheel


class _FakeEvent:
    raises = True

    def record(self):
        if _FakeEvent.raises:  # what torch/mps/event.py of the 2.15.0 wheel does off the default stream
            raise NotImplementedError("Non-default streams are not yet supported.")

    def wait(self):
        self.record()


@pytest.mark.parametrize("raises", [True, False])
def test_cross_stream_events_probed_on_a_side_stream(monkeypatch, fresh_probes, raises):
    """2.15.0 has torch.mps.Stream but its Event raises off the default stream: the probe records and
    waits on an event inside a side stream and decides either way, whatever the version says."""
    import contextlib

    import torch

    monkeypatch.setattr(torch.mps, "Stream", _FakeMpsStream, raising=False)
    monkeypatch.setattr(torch.mps, "stream", lambda s: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(torch.mps, "Event", _FakeEvent, raising=False)
    monkeypatch.setattr(_FakeEvent, "raises", raises)
    v = check("cross_stream_events", _real_mps("2.15.0"))
    assert v.decided_by == "probed" and v.ok is (not raises), v.reason
    if raises:
        assert "Non-default streams are not yet supported." in v.reason
    else:
        assert "present in this build" in v.reason


def test_streams_probed_absent_without_torch_mps_stream(monkeypatch, fresh_probes):
    import torch

    if hasattr(torch.mps, "Stream"):
        monkeypatch.delattr(torch.mps, "Stream")
    v = check("device_streams", _real_mps("2.16.0.dev20261101"))
    assert not v.ok and v.decided_by == "probed" and "pytorch#191415" in v.reason


@pytest.mark.parametrize(
    "feature, attr", [("mps_compile_shader", "compile_shader"), ("mps_load_metallib", "load_metallib")]
)
def test_metal_library_apis_are_probed_and_reported(monkeypatch, fresh_probes, feature, attr):
    import torch

    assert gate.FEATURES[feature].probe_decides
    monkeypatch.setattr(torch.mps, attr, lambda *a, **k: None, raising=False)
    assert check(feature, _real_mps("2.15.0")).decided_by == "probed"
    gate.clear_probe_cache()
    monkeypatch.delattr(torch.mps, attr)
    v = check(feature, _real_mps("2.15.0"))
    assert not v.ok and v.decided_by == "probed" and f"torch.mps.{attr}" in v.reason


def test_streams_probe_on_a_build_without_mps_streams(monkeypatch, fresh_probes):
    import torch

    if hasattr(torch.mps, "Stream"):
        monkeypatch.delattr(torch.mps, "Stream")
    v = gate._probe_streams(_real_mps("2.16.0.dev20261101"))
    assert v is not None and not v.ok and "pytorch#191415" in v.reason


def test_conv3d_entry_decides_what_the_qwen_single_frame_path_claims():
    """Before 2.14 the 2-D path is sold on speed (slow conv3d); from 2.14 on memory and a pad-free graph."""
    import mpsboost
    from tiny_models import build

    vae = build("qwen_image_vae")
    rows = {
        tv: mpsboost.plan(vae, device="mps", torch_version=tv, recipes=["qwen_image_vae"]).rows[0]
        for tv in ("2.13.0", "2.14.1", "2.15.0")
    }
    assert "conv3d is slow on this build" in rows["2.13.0"].reason and "pytorch#188802" in rows["2.13.0"].reason
    for tv in ("2.14.1", "2.15.0"):
        assert rows[tv].status == "would apply"
        assert "buys memory" in rows[tv].reason and "not speed" in rows[tv].reason, rows[tv].reason


def test_doctor_shows_upstream_dates_conditions_and_decider(capsys):
    import json

    from mpsboost.cli import main as cli_main

    assert cli_main(["doctor", "--device", "mps", "--torch", "2.13.0.dev20260510", "--all"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # doctor wraps its lines
    assert "sdpa_metal_gqa" in out and "merged 2026-05-11" in out and "first release 2.13.0" in out
    assert "predates the merge" in out and "[by version]" in out
    assert "fp16/bf16" in out and "macOS >= 26.2" in out
    assert cli_main(["doctor", "--device", "mps", "--torch", "2.15.0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    f = info["features"]["sdpa_large_scores_correct"]
    assert (
        f["available"] is False
        and f["decided_by"] == "by version"
        and f["rules"][0]["first_release"].startswith("none")
    )
    # the real CPU build: API/dtype features are confirmed by a probe
    gate.clear_probe_cache()
    assert cli_main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    if info["env"]["device_type"] == "cpu":
        assert info["features"]["float8_storage"]["decided_by"] == "probed"
        assert info["features"]["histc_int"]["decided_by"] == "by version"


def test_the_contributing_guide_quotes_a_real_gate_row():
    """docs/contributing.md, "a gate feature is a row": its worked example (the fact, the row, the test line)
    is the code as it stands, each block verbatim in the file it names, and the fields it lists exist."""
    import dataclasses
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "contributing.md").read_text()
    section = text.split("## A gate feature is a row\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    files = [root / "tools" / "wheel_facts.py", root / "src" / "mpsboost" / "gate" / "features.py", Path(__file__)]
    assert len(blocks) == len(files)
    for block, path in zip(blocks, files):
        assert block in path.read_text(), f"the guide's example is not in {path.name}:\n{block}"
    for name in re.findall(r"`(\w+)` \(", section.split("`Rule` fields:", 1)[1].split("\n\n", 1)[0]):
        assert name in {f.name for f in dataclasses.fields(Rule)}, name
    assert "--offline" in section and "python benchmarks/tables.py" in section
