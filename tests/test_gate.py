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
    [("2.14.1", False), ("2.15.0", True), ("2.15.0a0+gitabc1234", True), ("2.15.0+cpu", True), ("2.16.0.dev20261101", True), ("2.13.0", False)],
)
def test_mps_215_features(version, ok):
    env = Env.simulate("mps", version)
    for feat in ("pad_constant_native", "pad_rank5_correct", "grouped_mm", "float8_storage", "scaled_mm",
                 "gemv_bias_epilogue", "linear_3d_fast", "softmax_native", "sdpa_broadcast"):
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
    for feat in ("device_streams", "metal_attention"):
        assert not check(feat, Env.simulate("mps", "2.15.0")).ok
        assert "2.16" in check(feat, Env.simulate("mps", "2.15.0")).reason
        assert check(feat, Env.simulate("mps", "2.16.0")).ok


def test_nightly_merge_date(monkeypatch):
    merged = dt.date(2026, 10, 15)
    feat = Feature("test_feature", "a test feature", {"mps": (Rule(since="2.16", nightly_only=True, merged=merged, upstream="pytorch#1"),)})
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
