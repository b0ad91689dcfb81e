"""mpsboost.ondevice.choose: the patch-time choice a real Mac makes by timing, driven here by an injected timer and a
stubbed real-Mac environment (nothing on this machine is an MPS device)."""

from __future__ import annotations

import json

import pytest
import tiny_models as tm

from mpsboost import ondevice
from mpsboost.gate import Env, parse_torch_version
from mpsboost.ondevice import Contender, TimingCache, choose


real_mac = tm.real_mac
FakeTimer = tm.FakeTimer


def contenders():
    def stock():
        return None

    def fused():
        return None

    return Contender("composed aten ops", stock), Contender("fused Metal kernel", fused)


def run(env, timer, tmp_path, *, static=False, check=None, mode="auto", shape=(1, 2048), chip="Apple M3 Ultra"):
    s, c = contenders()
    return choose(
        "deltanet_step",
        shape,
        env=env,
        stock=s,
        candidate=c,
        static=static,
        check=check,
        mode=mode,
        timer=timer,
        cache=TimingCache(tmp_path / "t.json"),
        chip=chip,
    )


def test_faster_candidate_is_taken_with_its_ratio(tmp_path):
    timer = FakeTimer({"stock": 10e-6, "fused": 6e-6})
    ch = run(real_mac(), timer, tmp_path)
    assert ch.taken and ch.source == "timed" and ch.path == "fused Metal kernel"
    assert ch.ratio == pytest.approx(0.6) and ch.rounds == ondevice.ROUNDS
    assert timer.calls.count("stock") == timer.calls.count("fused") == ondevice.ROUNDS
    assert "0.60x" in ch.describe()


def test_rounds_alternate_which_path_runs_first(tmp_path):
    timer = FakeTimer({"stock": 10e-6, "fused": 6e-6})
    run(real_mac(), timer, tmp_path)
    firsts = timer.calls[0::2]
    assert firsts[:2] == ["stock", "fused"]


@pytest.mark.parametrize("fused", [10e-6, 9.9e-6, 12e-6])
def test_a_tie_or_a_slower_candidate_goes_to_stock(tmp_path, fused):
    ch = run(real_mac(), FakeTimer({"stock": 10e-6, "fused": fused}), tmp_path)
    assert not ch.taken and ch.path == "composed aten ops" and ch.source == "timed"


def test_the_median_decides_not_one_lucky_round(tmp_path):
    # one round far faster, four slower: the median ratio is above 1
    ch = run(real_mac(), FakeTimer({"stock": 10e-6, "fused": [1e-6, 11e-6, 11e-6, 11e-6, 11e-6]}), tmp_path)
    assert not ch.taken and ch.spread[0] == pytest.approx(0.1)


def test_cache_hit_times_nothing_and_keeps_the_verdict(tmp_path):
    first = run(real_mac(), FakeTimer({"stock": 10e-6, "fused": 5e-6}), tmp_path)
    timer = FakeTimer({"stock": 10e-6, "fused": 50e-6})
    again = run(real_mac(), timer, tmp_path)
    assert timer.calls == [] and again.source == "cache"
    assert again.taken == first.taken and again.ratio == pytest.approx(first.ratio)
    raw = json.loads((tmp_path / "t.json").read_text())
    assert raw["format"] == ondevice.CACHE_FORMAT and len(raw["entries"]) == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(env=real_mac("2.16.0.dev20261201")),
        dict(env=real_mac(macos=(26, 2))),
        dict(chip="Apple M1"),
        dict(shape=(4, 2048)),
    ],
)
def test_cache_is_keyed_by_torch_macos_chip_and_shape(tmp_path, change):
    run(real_mac(), FakeTimer({"stock": 10e-6, "fused": 5e-6}), tmp_path)
    timer = FakeTimer({"stock": 10e-6, "fused": 50e-6})
    kw = dict(env=real_mac())
    kw.update(change)
    env = kw.pop("env")
    ch = run(env, timer, tmp_path, **kw)
    assert ch.source == "timed" and not ch.taken and timer.calls


@pytest.mark.parametrize("failure", ["returns", "raises"])
def test_failed_self_check_takes_stock_and_times_nothing(tmp_path, failure):
    def check():
        if failure == "raises":
            raise RuntimeError("compile_shader: syntax error")
        return "max error 3e-1 against the composed path"

    timer = FakeTimer({"stock": 10e-6, "fused": 1e-6})
    ch = run(real_mac(), timer, tmp_path, check=check)
    assert not ch.taken and ch.source == "self-check failed" and timer.calls == []
    assert ("syntax error" if failure == "raises" else "3e-1") in ch.reason
    assert not (tmp_path / "t.json").exists()


def test_passing_self_check_then_timed(tmp_path):
    ch = run(real_mac(), FakeTimer({"stock": 10e-6, "fused": 1e-6}), tmp_path, check=lambda: None)
    assert ch.taken and ch.source == "timed"


@pytest.mark.parametrize("bad", ["raise", "zero"])
def test_timing_error_falls_back_to_stock(tmp_path, bad):
    def timer(fn):
        if bad == "raise" and fn.__name__ == "fused":
            raise RuntimeError("MPS command buffer error")
        return 0.0 if bad == "zero" else 1e-5

    ch = run(real_mac(), timer, tmp_path)
    assert not ch.taken and ch.source == "timing error" and ch.path == "composed aten ops"
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(
    "env",
    [
        Env.simulate("mps", "2.15.0"),
        Env.simulate("cuda", "2.15.0"),
        Env.simulate("cpu", "2.15.0"),
        Env(torch_version=parse_torch_version("2.15.0"), device_type="cpu"),
        Env(torch_version=parse_torch_version("2.15.0"), device_type="cuda", capability=(9, 0)),
    ],
)
@pytest.mark.parametrize("static", [True, False])
def test_nothing_is_timed_off_a_real_mac(tmp_path, env, static):
    timer = FakeTimer({"stock": 10e-6, "fused": 1e-6})
    ch = run(env, timer, tmp_path, static=static, check=lambda: pytest.fail("self-check run off a Mac"))
    assert timer.calls == [] and ch.source == "static" and ch.taken is static
    assert not (tmp_path / "t.json").exists()


def test_static_mode_keeps_the_static_choice_on_a_mac(tmp_path):
    timer = FakeTimer({"stock": 10e-6, "fused": 1e-6})
    ch = run(real_mac(), timer, tmp_path, static=False, mode="static")
    assert timer.calls == [] and not ch.taken and "option" in ch.reason
    with pytest.raises(ValueError, match="mode must be one of"):
        run(real_mac(), timer, tmp_path, mode="fast")


@pytest.mark.parametrize(
    "text", ["{not json", json.dumps({"format": "other", "version": 1, "entries": {}}), json.dumps([1, 2])]
)
def test_a_foreign_or_broken_cache_file_is_never_trusted(tmp_path, text):
    (tmp_path / "t.json").write_text(text)
    timer = FakeTimer({"stock": 10e-6, "fused": 5e-6})
    ch = run(real_mac(), timer, tmp_path)
    assert ch.source == "timed" and timer.calls
    assert json.loads((tmp_path / "t.json").read_text())["format"] == ondevice.CACHE_FORMAT


def test_a_forged_entry_is_not_trusted(tmp_path):
    run(real_mac(), FakeTimer({"stock": 10e-6, "fused": 5e-6}), tmp_path)
    raw = json.loads((tmp_path / "t.json").read_text())
    (key,) = raw["entries"]
    raw["entries"][key]["ratio"] = -1
    (tmp_path / "t.json").write_text(json.dumps(raw))
    timer = FakeTimer({"stock": 10e-6, "fused": 50e-6})
    assert run(real_mac(), timer, tmp_path).source == "timed"


def test_unwritable_cache_still_decides(tmp_path, monkeypatch):
    def refuse(self, key, entry):
        raise PermissionError("read-only cache folder")

    monkeypatch.setattr(TimingCache, "put", refuse)
    ch = run(real_mac(), FakeTimer({"stock": 10e-6, "fused": 5e-6}), tmp_path)
    assert ch.taken and "not cached" in ch.reason


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSBOOST_CACHE_DIR", str(tmp_path))
    assert ondevice.cache_path() == tmp_path / "ondevice-timings.json"
    monkeypatch.delenv("MPSBOOST_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if ondevice.sys.platform != "darwin":
        assert ondevice.cache_path() == tmp_path / "xdg" / "mpsboost" / "ondevice-timings.json"
