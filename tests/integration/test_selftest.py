"""``mpsboost selftest`` on this CPU: refusal of an absent device, the probes, the workloads, the files,
the validator on good, all-error, fake-MPS and broken files, and the absence of personal data."""

from __future__ import annotations

import getpass
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from mpsboost import gate, selftest
from mpsboost.cli import main as cli_main
from mpsboost.selftest import PROBES, SEED_WORKLOADS, SelftestFormatError, validate
from mpsboost.selftest.machine import REQUIRED_FACTS, scrub

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
CHECKED_RECIPES = ["wan_vae_pad", "metal_attention", "fp8_weights"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU selftest at the test size (every probe, every workload, three recipe checks), shared below."""
    out = tmp_path_factory.mktemp("selftest")
    printed: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared CPU: thread hand-offs would cost more than the work
    try:
        lines, jsonl, md = selftest.run_selftest(
            "cpu",
            size="test",
            processes=1,
            budget_s=selftest.BUDGET_S["test"],  # not the CPU's default: every workload must run here
            out_dir=out,
            recipes=CHECKED_RECIPES,
            echo=printed.append,
        )
    finally:
        torch.set_num_threads(threads)
    return lines, jsonl, md, "\n".join(printed)


def _by(lines, kind):
    key = "recipe" if kind == "recipe" else "feature" if kind == "gate" else "name"
    return {x[key]: x for x in lines if x["kind"] == kind}


def test_cpu_selftest_writes_a_file_that_validates(run):
    _, jsonl, md, printed = run
    assert jsonl.name == f"mpsboost-selftest-cpu-{torch.__version__}.jsonl" and md.name == jsonl.name[:-6] + ".md"
    summary = validate(jsonl)
    assert summary["machine"]["device"] == "cpu" and summary["machine"]["torch"] == torch.__version__
    assert set(summary["probes"]) == set(PROBES) and set(summary["workloads"]) == set(SEED_WORKLOADS)
    assert summary["recipes"] == {"wan_vae_pad": "pass", "metal_attention": "not applicable", "fp8_weights": "pass"}
    assert set(summary["gate"]) == set(gate.FEATURES)
    assert "probe pad_rank5_65536" in printed and "workload qwen36_decode" in printed


def test_a_run_without_mps_says_in_one_line_that_its_file_is_not_evidence(run, capsys):
    lines, jsonl, md, printed = run
    notes = [ln for ln in printed.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "not an MPS device (cpu)" in notes[0], notes
    assert printed.splitlines()[1] == notes[0]  # right after the first line, before any probe
    assert notes[0] in md.read_text() and "Send it:" not in md.read_text()
    assert printed.splitlines()[-1].endswith("not evidence: do not send them")
    assert lines[0]["evidence"] is False
    # `mpsboost selftest --validate` (what a user runs before sending) refuses it, in one line
    assert cli_main(["selftest", "--validate", str(jsonl)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a selftest on cpu, not on MPS: not evidence" in err and len(err.splitlines()) == 1, err


def test_every_probe_names_its_upstream_number_and_a_known_feature(run):
    lines, *_ = run
    probes = _by(lines, "probe")
    for name, p in PROBES.items():
        assert p.upstream and all("#" in u for u in p.upstream), name
        assert p.feature is None or p.feature in gate.FEATURES, (name, p.feature)
        assert probes[name]["upstream"] == list(p.upstream)
    cited = {u for p in PROBES.values() for u in p.upstream}
    for number in ("194922", "194917", "194074", "196916", "189847", "196071", "179352", "182815", "195368"):
        assert any(number in u for u in cited), number


def test_probes_run_on_the_cpu_and_say_not_applicable(run):
    """The bugs are MPS-only: on the CPU each probe still runs (small sizes) and says so."""
    lines, *_ = run
    for name, p in _by(lines, "probe").items():
        if name == "gemm_fresh_process":  # one process: nothing to compare across
            assert p["verdict"] == "skipped" and "processes" in p["detail"]
            continue
        if name == "fp8_metal_gemv":  # mpsboost's own kernel: not a torch bug, and not called one
            assert p["verdict"] == "not applicable" and "bug;" not in p["detail"], p
            assert p["detail"].startswith("mpsboost's own Metal kernel, not a torch bug"), p
            continue
        assert p["verdict"] == "not applicable" and p["detail"].startswith("MPS-only bug; on cpu"), (name, p)
    assert _by(lines, "probe")["pad_rank5_65536"]["measured"]["wrong_fraction"] == 0.0


def test_a_recipe_without_a_tiny_check_names_the_workloads_that_ran_it(run):
    """The recipes the Qwen3.6 workloads apply (linear_attention, moe_block, ...) have no tiny check of their own:
    their lines and the report say which workloads of this run exercised them and how those went, not a bare
    "no workload" right after those workloads passed."""
    from mpsboost.selftest import run as run_mod
    from mpsboost.selftest.report import markdown

    lines, *_ = run
    wls = [x for x in lines if x["kind"] == "workload"]
    covered = run_mod._covered(wls)
    assert {"linear_attention", "moe_block"} <= set(covered)
    printed: list[str] = []
    recs = run_mod._recipe_lines(
        "cpu", "float32", ["linear_attention", "moe_block"], 1, float("inf"), printed.append, covered=covered
    )
    for r in recs:
        assert r["status"] == "no workload"
        ran = [f"{w['name']} ({w['status']})" for w in wls if r["recipe"] in w["recipes"]]
        assert ran and r["reason"] == f"no tiny check of its own; exercised by the workloads above: {', '.join(ran)}"
        assert "qwen36_decode (pass)" in r["reason"]
    md = markdown([lines[0]] + wls + recs, "x.jsonl")
    assert f"- linear_attention: no workload ({recs[0]['reason']})" in md
    assert any("linear_attention: no workload (no tiny check of its own" in p for p in printed)


def test_workloads_stock_against_patched_on_the_cpu(run):
    lines, *_ = run
    w = _by(lines, "workload")
    for name in (
        "wan22_vae_tiled_decode",
        "qwen_image_vae_roundtrip",
        "qwen36_decode",
        "qwen36_prefill",
        "qwen36_fp8_decode",
        "fp8_linear_m1",
        "fp8_linear_m1024",
    ):
        assert w[name]["status"] == "pass", (name, w[name].get("reason"))
        assert w[name]["ratio"]["median"] > 0 and w[name]["ratio"]["processes"] == 1
        assert w[name]["vs_stock"]["rel_error"] <= w[name]["tolerance"]
        for side in ("stock", "patched"):
            assert set(w[name][side]["memory"]) >= {"tensor_allocated", "allocator_reserved", "driver_level"}
            assert w[name][side]["memory"]["driver_level"] > 0  # process RSS on the CPU
    # the VAEs carry PSNR against the CPU fp32 reference; fp8 is lossy but bounded
    assert w["qwen_image_vae_roundtrip"]["patched"]["vs_cpu"]["psnr_db"] > 60
    assert 1e-3 < w["fp8_linear_m1024"]["vs_stock"]["rel_error"] < 0.1
    assert (
        "qwen_image_vae" in w["qwen_image_vae_roundtrip"]["recipes"] and "fp8_weights" in w["fp8_linear_m1"]["recipes"]
    )
    # the prefill workload runs the recipe's chunked prefill (two chunks at test size)
    assert "linear_attention" in w["qwen36_prefill"]["recipes"] and w["qwen36_prefill"]["shape"]["decode_steps"] == 0
    # Qwen-Image-2.1: its recipe may not be merged yet; stock is measured against the CPU either way
    q21 = w["qwen_image21_vae_roundtrip"]
    assert q21["status"] in ("pass", "not applicable") and q21["stock"]["vs_cpu"]["psnr_db"] > 60


def test_no_personal_data_in_the_files(run):
    lines, jsonl, md, _ = run
    text = jsonl.read_text() + md.read_text()
    for secret in (os.path.expanduser("~"), str(jsonl.parent), str(jsonl.parent.resolve()), os.getcwd()):
        assert secret not in text, secret
    for name in (getpass.getuser(), socket.gethostname()):
        if len(name) >= 3:
            assert f'"{name}"' not in text and f" {name} " not in text, name
    machine = lines[0]["machine"]
    assert set(REQUIRED_FACTS) <= set(machine)
    assert not {"user", "hostname", "host", "node", "path", "home"} & set(machine)
    assert "No personal data" in md.read_text()


def test_scrub_removes_home_user_host_and_the_output_folder(tmp_path):
    home = os.path.expanduser("~")
    msg = f"OSError: {home}/models/vae.safetensors and {tmp_path}/x.jsonl"
    clean = scrub(msg, (str(tmp_path),))
    assert (
        home not in clean
        and str(tmp_path) not in clean
        and "~/models/vae.safetensors" in clean
        and "<out>/x.jsonl" in clean
    )
    user = getpass.getuser()
    if len(user) >= 3:
        assert user not in scrub(f"owned by {user}.")
        assert scrub(f"latest {user}x") == f"latest {user}x"  # whole names only


def test_markdown_says_what_it_holds_and_where_to_send_it(run, tmp_path):
    _, jsonl, md, _ = run
    text = md.read_text()
    # a CPU run: the report says not to send it, and names no place to send it to
    assert "not evidence" in text and selftest.issue_tracker() not in text
    assert "What the file contains" in text and "pytorch#194922" in text and "qwen36_decode" in text
    assert "Decisions to revisit" in text
    mac = [json.loads(x) for x in _rewrite(jsonl, tmp_path / "mac.jsonl", _as_mac()).read_text().splitlines()]
    mac_text = selftest.markdown(mac, jsonl.name)
    # the banner above the first section: a probe row may still quote what its CPU run said of itself
    assert selftest.issue_tracker() in mac_text and jsonl.name in mac_text
    assert "not evidence" not in mac_text.split("\n### ")[0]


def test_the_tracker_url_lives_in_one_place():
    from importlib.resources import files

    data = json.loads(files("mpsboost").joinpath("data/project.json").read_text())
    assert selftest.issue_tracker() == (data["issues_url"] or data["issues_placeholder"])


# ------------------------------------------------------------------------------------------ refusal


@pytest.mark.parametrize(
    "device", ["mps", "cuda"], ids=["apple-gpu", "nvidia-gpu"]
)  # ids: conftest skips "mps"/"cuda" keywords
def test_absent_device_is_refused_exit_2_and_no_file(tmp_path, capsys, monkeypatch, device):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert cli_main(["selftest", "--device", device, "--out", str(out), "--size", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--device {device}" in err and "nothing was run or written" in err
    assert not out.exists() and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ validation


def _rewrite(src: Path, dst: Path, edit) -> Path:
    recs = [json.loads(line) for line in src.read_text().splitlines()]
    dst.write_text("".join(json.dumps(r) + "\n" for r in edit(recs)))
    return dst


def _all_error(recs):
    out = [recs[0]]
    for r in recs[1:]:
        r = dict(r)
        if r["kind"] == "probe":
            r["verdict"] = "error"
        elif r["kind"] in ("workload", "recipe"):
            r["status"] = "error"
        out.append(r)
    return out


def _machine(**kw):
    def edit(recs):
        return [dict(recs[0], machine=dict(recs[0]["machine"], **kw))] + recs[1:]

    return edit


# What the macOS arm64 wheel of torch writes (no local version tag, no CUDA): a forged Mac file takes its
# torch from here, never from this machine, whose build may be +cpu, +cu130 or a Mac's own.
MAC_TORCH = {"torch": "2.15.0", "torch_build": "no cuda, git 6b1f4c2a9e, release"}


def _as_mac(chip="Apple M3 Max", **kw):
    """The lines as an Apple-silicon Mac would have written them: the machine facts and the environment of
    every record they carry agree (device mps, Darwin, the chip in the device name, the macOS wheel's torch
    build :data:`MAC_TORCH`); ``kw`` then edits the machine facts alone."""
    facts = dict(
        device="mps",
        os="Darwin",
        arch="arm64",
        macos="15.1",
        mps_available=True,
        mps_built=True,
        chip=chip,
        device_name=f"Apple MPS ({chip})",
        **MAC_TORCH,
    )

    def env(e):
        return dict(
            e,
            device_type="mps",
            device_name=f"Apple MPS ({chip})",
            os="Darwin 24.1.0",
            torch_version=MAC_TORCH["torch"],
            torch_build=MAC_TORCH["torch_build"],
            torch_cuda=None,
        )

    def edit(recs):
        out = [dict(recs[0], machine={**recs[0]["machine"], **facts, **kw})]
        for r in recs[1:]:
            if r.get("records"):
                r = dict(r, records=[dict(x, env=env(x["env"])) for x in r["records"]])
            out.append(r)
        return out

    return edit


def _drop_fact(fact):
    def edit(recs):
        m = dict(recs[0]["machine"])
        del m[fact]
        return [dict(recs[0], machine=m)] + recs[1:]

    return edit


@pytest.mark.parametrize(
    "what, edit, message",
    [
        ("all errors", _all_error, "no successful case"),
        ("fake MPS from Linux", _machine(device="mps", device_name="Apple MPS (x86_64)"), "claims device 'mps'"),
        (
            "fake MPS on an Intel Mac",
            _machine(device="mps", os="Darwin", arch="x86_64", macos="14.5", mps_available=True),
            "arch 'x86_64'",
        ),
        (
            "MPS absent",
            _machine(device="mps", os="Darwin", arch="arm64", macos="15.1", mps_available=False),
            "MPS not available",
        ),
        ("simulated", _machine(simulated=True), "simulated"),
        ("simulated line", lambda rs: rs[:1] + [dict(rs[1], simulated=True)] + rs[2:], "simulated"),
        ("no chip", _drop_fact("chip"), "machine facts missing: chip"),
        ("no memory size", _machine(memory_bytes=None), "machine facts missing: memory_bytes"),
        ("no header", lambda rs: rs[1:], "first line must be the selftest header"),
        ("old schema", lambda rs: [dict(rs[0], schema=1)] + rs[1:], "schema 1"),
        (
            "probe without upstream",
            lambda rs: [dict(r, upstream=[]) if r["kind"] == "probe" else r for r in rs],
            "names no upstream",
        ),
        (
            "bad verdict",
            lambda rs: [dict(r, verdict="maybe") if r["kind"] == "probe" else r for r in rs],
            "verdict 'maybe'",
        ),
        (
            "workload without ratio",
            lambda rs: [dict(r, ratio=None) if r["kind"] == "workload" and r["status"] == "pass" else r for r in rs],
            "no positive speed ratio",
        ),
        ("duplicate", lambda rs: rs + [rs[-1]], "a second"),
        ("two headers", lambda rs: rs + [rs[0]], "a second header"),
        ("not a selftest line", lambda rs: rs + [{"hello": 1}], "not a selftest line"),
    ],
)
def test_validator_rejects(run, tmp_path, what, edit, message):
    _, jsonl, _, _ = run
    bad = _rewrite(jsonl, tmp_path / "bad.jsonl", edit)
    with pytest.raises(SelftestFormatError, match=message):
        validate(bad)
    assert cli_main(["selftest", "--validate", str(bad)]) == 2


def test_a_real_mac_file_is_accepted(run, tmp_path):
    """The same lines with the machine facts of an Apple-silicon Mac pass (the check is on the facts)."""
    _, jsonl, _, _ = run
    good = _rewrite(jsonl, tmp_path / "mac.jsonl", _as_mac())
    assert validate(good)["machine"]["chip"] == "Apple M3 Max"
    assert validate(good, require_mps=True)["machine"]["device"] == "mps"
    assert cli_main(["selftest", "--validate", str(good)]) == 0


CONTRADICTIONS = [
    (
        "a CPU file hand-edited to name an Apple chip",
        _machine(chip="Apple M4 Max", device_name="Apple M4 Max"),
        "chip 'Apple M4 Max' and device_name 'Apple M4 Max' on os 'Linux'",
    ),
    ("a Mac file from a CUDA torch build", _as_mac(torch_build="cuda 13.0, git 0123456789, release"), "CUDA"),
    (
        "a device name that is not the chip's",
        _as_mac(chip="Apple M4 Max", device_name="Apple MPS (Apple M1)"),
        "does not name the chip",
    ),
    (
        "an MPS device name on the CPU",
        _machine(device_name="Apple MPS (Apple M3 Max)"),
        "device 'cpu' with device_name",
    ),
    (
        "a Mac header on records measured on the CPU",
        _machine(
            device="mps",
            os="Darwin",
            arch="arm64",
            macos="15.1",
            mps_available=True,
            mps_built=True,
            chip="Apple M3 Max",
            device_name="Apple MPS (Apple M3 Max)",
            **MAC_TORCH,
        ),
        "measured elsewhere than the header says: device 'cpu'",
    ),
]


@pytest.mark.parametrize("what, edit, message", CONTRADICTIONS)
def test_validator_rejects_facts_that_contradict_each_other(run, tmp_path, what, edit, message):
    _, jsonl, _, _ = run
    bad = _rewrite(jsonl, tmp_path / "bad.jsonl", edit)
    with pytest.raises(SelftestFormatError, match=message):
        validate(bad)
    assert cli_main(["selftest", "--validate", str(bad)]) == 2


def _as_built(monkeypatch, version: str, cuda: str | None):
    """The lines as this run would have written them under another torch build (``version``, CUDA ``cuda``):
    the header's torch facts and every record's environment come from the code that writes them
    (``machine.facts``, ``RecordEnv.capture``), with torch's version strings simulated."""
    from mpsboost.bench import RecordEnv
    from mpsboost.selftest import machine

    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", version)
        m.setattr(torch.version, "cuda", cuda)
        head = machine.facts("cpu")
        env = RecordEnv.capture("cpu", torch.float32).to_dict()
    keys = ("torch_version", "torch_build", "torch_cuda")

    def edit(recs):
        out = [dict(recs[0], machine=dict(recs[0]["machine"], torch=head["torch"], torch_build=head["torch_build"]))]
        for r in recs[1:]:
            if r.get("records"):
                r = dict(r, records=[dict(x, env=dict(x["env"], **{k: env[k] for k in keys})) for x in r["records"]])
            out.append(r)
        return out

    return edit


@pytest.mark.parametrize(
    "version, cuda",
    [("2.13.0+cpu", None), ("2.14.1+cu130", "13.0"), ("2.15.0", None)],
    ids=["cpu wheel", "cuda wheel (what pip gives Linux)", "macOS wheel"],
)
def test_the_mac_file_tests_hold_on_every_torch_build(run, tmp_path, monkeypatch, version, cuda):
    """The forged Mac files above do not depend on this machine's torch build: a run under the CPU, the CUDA
    or the macOS wheel gives a valid CPU file, its Mac forgery is accepted, and each contradiction is still
    rejected with its own message."""
    _, jsonl, _, _ = run
    built = _rewrite(jsonl, tmp_path / "built.jsonl", _as_built(monkeypatch, version, cuda))
    head = json.loads(built.read_text().splitlines()[0])["machine"]
    assert head["torch"] == version and head["torch_build"].startswith(f"cuda {cuda}," if cuda else "no cuda,")
    assert validate(built)["machine"]["device"] == "cpu"
    mac = validate(_rewrite(built, tmp_path / "mac.jsonl", _as_mac()), require_mps=True)["machine"]
    assert (mac["device"], mac["torch"]) == ("mps", MAC_TORCH["torch"])
    for what, edit, message in CONTRADICTIONS:
        with pytest.raises(SelftestFormatError, match=message):
            validate(_rewrite(built, tmp_path / "bad.jsonl", edit))


def test_the_budget_is_checked_inside_a_workload_with_progress(tmp_path):
    """The budget runs out while a workload runs (an injected clock jumps past it once the stock run has
    started): the workload stops before its next step and says which; every step started was printed."""
    now = [0.0]
    printed: list[str] = []

    def echo(line: str) -> None:
        printed.append(line)
        if "fp8_linear_m1: stock run" in line:
            now[0] = 1e9  # the stock run "took" longer than the whole budget

    lines, _, _ = selftest.run_selftest(
        "cpu",
        size="test",
        processes=2,
        budget_s=100.0,
        out_dir=tmp_path,
        probes=[],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=echo,
        clock=lambda: now[0],
    )
    (w,) = [x for x in lines if x["kind"] == "workload"]
    assert w["status"] == "skipped" and w["reason"] == "time budget spent before stock timing", w
    steps = [ln.split(": ", 1)[1].split(" (")[0] for ln in printed if ln.startswith("    fp8_linear_m1: ")]
    assert steps == ["build", "stock run"], printed
    assert lines[0]["process_notes"] == ["process 2: not started (time budget spent)"]


def test_validator_names_file_and_line(run, tmp_path):
    _, jsonl, _, _ = run
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl.read_text() + "{not json\n")
    n = len(jsonl.read_text().splitlines()) + 1
    with pytest.raises(SelftestFormatError, match=rf"bad.jsonl:{n}: not JSON"):
        validate(bad)
    with pytest.raises(SelftestFormatError, match="no such file"):
        validate(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SelftestFormatError, match="empty file"):
        validate(tmp_path / "empty.jsonl")


def test_validator_on_benchmark_results():
    """Other result files are refused with a clear message; contributed Mac files validate."""
    for f in sorted(RESULTS.glob("*.jsonl"))[:5]:
        with pytest.raises(
            SelftestFormatError, match="a bench record, not a selftest line|not a selftest line|not JSON"
        ):
            validate(f)
    for f in sorted((RESULTS / "mac").glob("*.jsonl")):
        assert validate(f)["machine"]["device"] == "mps"


# ------------------------------------------------------------------------------------------ runs


def test_a_failing_workload_is_reported_not_raised(tmp_path, monkeypatch):
    """A patched output that drifts from stock fails its workload; the file is written and still valid (a finding)."""
    from mpsboost.selftest import workloads

    real = workloads._quality

    def drifting(x, ref, metric):
        return real(x + 1.0, ref, metric)

    monkeypatch.setattr(workloads, "_quality", drifting)
    lines, jsonl, _ = selftest.run_selftest(
        "cpu",
        size="test",
        processes=1,
        out_dir=tmp_path,
        probes=[],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=lambda s: None,
    )
    (w,) = [x for x in lines if x["kind"] == "workload"]
    assert w["status"] == "fail" and "patched vs stock" in w["reason"]
    assert validate(jsonl)["workloads"] == {"fp8_linear_m1": "fail"}


def test_each_release_collects_within_a_frozen_heap_handed_back_at_the_end(tmp_path, monkeypatch):
    """The probes' and workloads' hand-backs run inside ``frozen_heap``: each ``gc.collect()`` traverses what the run
    made, not torch, transformers and diffusers; the heap is handed back when the run ends."""
    import gc

    from mpsboost.bench import harness

    counts: list[int] = []
    real = harness.release
    monkeypatch.setattr(harness, "release", lambda device: (counts.append(gc.get_freeze_count()), real(device)))
    selftest.run_selftest(
        "cpu",
        size="test",
        processes=1,
        out_dir=tmp_path,
        probes=["fp8_cast"],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=lambda s: None,
    )
    assert counts and min(counts) > 0, counts  # every release of the run, the probe's among them, frozen
    assert gc.get_freeze_count() == 0


def test_the_time_budget_skips_what_does_not_fit(tmp_path):
    lines, jsonl, _ = selftest.run_selftest(
        "cpu",
        size="test",
        processes=2,
        budget_s=1e-6,
        out_dir=tmp_path,
        probes=["fp8_cast"],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=lambda s: None,
    )
    assert [x["verdict"] for x in lines if x["kind"] == "probe"] == ["skipped"]
    assert [x["status"] for x in lines if x["kind"] == "workload"] == ["skipped"]
    assert lines[0]["process_notes"] == ["process 2: not started (time budget spent)"]
    with pytest.raises(SelftestFormatError, match="no successful case"):
        validate(jsonl)


@pytest.mark.slow
def test_cli_repeats_in_fresh_processes_and_reports_the_spread(tmp_path, capsys):
    rc = cli_main(
        [
            "selftest",
            "--device",
            "cpu",
            "--size",
            "test",
            "--processes",
            "2",
            "--probes",
            "gemm_fresh_process",
            "--workloads",
            "fp8_linear_m1",
            "--recipes",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0, capsys.readouterr()
    (jsonl,) = tmp_path.glob("mpsboost-selftest-cpu-*.jsonl")
    lines = selftest.read_lines(jsonl)
    (w,) = [x for x in lines if x["kind"] == "workload"]
    assert len(w["stock"]["seconds"]) == len(w["patched"]["seconds"]) == 2
    assert w["ratio"]["processes"] == 2 and w["ratio"]["min"] <= w["ratio"]["median"] <= w["ratio"]["max"]
    (g,) = [x for x in lines if x["kind"] == "probe"]
    assert len(g["measured"]["samples_s"]) == 2 and g["verdict"] == "not applicable"  # MPS-only, measured here
    assert lines[0]["command"].startswith("mpsboost selftest --device cpu") and str(tmp_path) not in lines[0]["command"]
    assert validate(jsonl)["workloads"] == {"fp8_linear_m1": "pass"}
    capsys.readouterr()
    assert cli_main(["selftest", "--validate", str(jsonl)]) == 2  # a well-formed CPU file, but no evidence
    assert "not on MPS: not evidence" in capsys.readouterr().err


def test_unknown_names_are_refused(tmp_path, capsys):
    assert cli_main(["selftest", "--device", "cpu", "--probes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown probe" in capsys.readouterr().err
    assert cli_main(["selftest", "--device", "cpu", "--recipes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown recipe" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ decisions


def test_every_mps_decision_lists_the_probe_that_would_overturn_it():
    rows = {r["feature"]: r for r in selftest.decisions()}
    mps = {n for n, f in gate.FEATURES.items() if "mps" in f.rules}
    assert set(rows) == mps
    for p in PROBES.values():
        if p.feature is not None:
            assert p.name in rows[p.feature]["selftest_probes"]
    assert rows["device_streams"]["gate_probe"] and rows["pad_rank5_correct"]["selftest_probes"] == ["pad_rank5_65536"]


def test_revisit_names_the_decision_a_probe_contradicts():
    probes = [
        {"name": "pad_rank5_65536", "feature": "pad_rank5_correct", "verdict": "fixed", "upstream": ["pytorch#194922"]},
        {"name": "fp8_cast", "feature": "float8_storage", "verdict": "fixed", "upstream": ["pytorch#194074"]},
        {"name": "linear_b1k", "feature": "linear_3d_fast", "verdict": "skipped", "upstream": ["pytorch#189847"]},
    ]
    todo = selftest.revisit(probes, {"pad_rank5_correct": False, "float8_storage": True, "linear_3d_fast": False})
    assert (
        len(todo) == 1
        and "pad_rank5_correct" in todo[0]
        and "pad_rank5_65536" in todo[0]
        and "pytorch#194922" in todo[0]
    )


def test_a_stock_failure_is_a_finding_when_patched_runs(tmp_path, monkeypatch):
    """A build whose stock path raises (a missing MPS kernel) and whose patched path runs: 'stock fails', a valid
    finding."""
    import mpsboost
    from mpsboost.selftest import workloads

    real_build = workloads.SEED_WORKLOADS["fp8_linear_m1"].build

    def build(size, device):
        built = real_build(size, device)
        inner = built.run

        def run(module):
            if not mpsboost.api.is_patched(module):
                raise NotImplementedError("The operator 'aten::linear' is not currently implemented for the MPS device")
            return inner(module)

        return workloads.Built(built.model, run, built.shape, built.dtype)

    monkeypatch.setitem(
        workloads.SEED_WORKLOADS,
        "fp8_linear_m1",
        workloads.SeedWorkload("fp8_linear_m1", "synthetic", build, metric="rel", cpu_reference=False, fp8="rowwise"),
    )
    lines, jsonl, md = selftest.run_selftest(
        "cpu",
        size="test",
        processes=1,
        out_dir=tmp_path,
        probes=[],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=lambda s: None,
    )
    (w,) = [x for x in lines if x["kind"] == "workload"]
    assert (
        w["status"] == "stock fails" and "NotImplementedError" in w["stock"]["error"] and w["patched"]["seconds"][0] > 0
    )
    assert validate(jsonl)["workloads"] == {"fp8_linear_m1": "stock fails"}
    assert "stock fails" in md.read_text()


# -------------------------------------------------------------------------------------- probes on a simulated MPS build


class _BuggyMps:
    """A Ctx whose 'device' tensors are CPU tensors marked as on a buggy MPS build (no device here)."""

    device, small, repeats = "mps", False, 1

    def __init__(self, fail: Exception | None = None):
        self.fail = fail

    def to(self, x):
        if self.fail is not None:
            raise self.fail
        y = x.clone()
        y._on_buggy_mps = True
        return y


def test_pad_probe_finds_the_rank5_bug_at_65536(monkeypatch):
    import torch.nn.functional as F

    from mpsboost.selftest import probes

    real = F.pad

    def buggy_pad(x, pad, mode="constant", value=None):
        out = real(x, pad, mode=mode)
        if getattr(x, "_on_buggy_mps", False) and x.dim() == 5 and x.shape[-1] * x.shape[-2] >= 65536:
            out = out.clone()
            out.view(-1)[: int(out.numel() * 0.8)] = 7.0  # pytorch#194922: about 80% of elements corrupt
        return out

    monkeypatch.setattr(F, "pad", buggy_pad)
    res = probes._pad_rank5(_BuggyMps())
    assert (
        res["verdict"] == "has the bug" and res["measured"]["hw"] == 65536 and res["measured"]["wrong_fraction"] > 0.5
    )
    fixed = probes._pad_rank5(type("Fixed", (_BuggyMps,), {"to": lambda self, x: x.clone()})())
    assert fixed["verdict"] == "fixed"


@pytest.mark.parametrize(
    "probe, error",
    [
        (
            "_fp8_cast",
            TypeError(
                "Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that dtype."
            ),
        ),
        (
            "_grouped_mm",
            NotImplementedError("The operator 'aten::_grouped_mm' is not currently implemented for the MPS device"),
        ),
    ],
)
def test_a_build_that_raises_has_the_bug(probe, error):
    from mpsboost.selftest import probes

    res = getattr(probes, probe)(_BuggyMps(error))
    assert res["verdict"] == "has the bug" and type(error).__name__ in res["detail"]


def test_fresh_process_gemm_verdict():
    from mpsboost.selftest.probes import gemm_verdict

    assert gemm_verdict([1e-3], "mps")["verdict"] == "skipped"
    assert gemm_verdict([1e-3, 1.05e-3, 0.98e-3], "mps")["verdict"] == "fixed"
    slow = gemm_verdict([1e-3, 2.6e-3, 1e-3], "mps")  # pytorch#182815: 2-3x in some processes
    assert slow["verdict"] == "has the bug" and slow["measured"]["spread"] == pytest.approx(2.6)
    assert gemm_verdict([1e-3, 2.6e-3], "cpu")["verdict"] == "not applicable"


def test_scrubbing_keeps_values_that_equal_a_user_name(monkeypatch):
    """A user called 'mps' or 'test': the device and size fields survive, a sentence loses the name."""
    from mpsboost.selftest import machine

    monkeypatch.setattr(machine.getpass, "getuser", lambda: "mps")
    lines = [
        {"kind": "selftest", "machine": {"device": "mps"}, "size": "test"},
        {"kind": "probe", "detail": "OSError: cannot open /Users/mps/x owned by mps"},
    ]
    clean = machine.scrub_all(lines)
    assert clean[0]["machine"]["device"] == "mps" and clean[0]["size"] == "test"
    assert "owned by <user>" in clean[1]["detail"]


def test_size_flags():
    parse = selftest.build_parser().parse_args
    assert parse([]).size == "quick" and parse(["--full"]).size == "full" and parse(["--size", "test"]).size == "test"
    with pytest.raises(SystemExit):
        parse(["--quick", "--full"])
    assert selftest.PROCESSES["quick"] >= 3 and selftest.BUDGET_S["quick"] < 600  # a Mac run stays under 10 minutes


def test_float32_tolerance_rises_to_tf32_only_on_cuda(monkeypatch):
    # cuDNN runs float32 convolutions in TF32 by default on CUDA: there two correct algorithms differ at
    # TF32's rounding (2^-11), so the float32 tolerance is at least 1e-3; elsewhere it is what was asked.
    import torch

    from mpsboost.selftest.machine import TF32_FLOOR, fp32_tolerance

    assert fp32_tolerance("cpu", "float32", 1e-4) == 1e-4
    assert fp32_tolerance("mps", "float32", 1e-4) == 1e-4
    assert fp32_tolerance("cuda", "bfloat16", 3e-2) == 3e-2
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert fp32_tolerance("cuda", "float32", 1e-4) == TF32_FLOOR == 1e-3
    assert fp32_tolerance("cuda:0", "float32", 5e-3) == 5e-3
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert fp32_tolerance("cuda", "float32", 1e-4) == 1e-4


def test_on_the_cpu_the_quick_run_uses_the_test_sizes(tmp_path):
    """On the CPU the file is no evidence and the quick sizes would take many minutes on two cores: the
    workloads run at their test size in one process (fresh processes are for MPS's per-process GEMM
    kernel choice), and the run says so."""
    printed: list[str] = []
    lines, jsonl, _ = selftest.run_selftest(
        "cpu",
        size="quick",
        out_dir=tmp_path,
        probes=[],
        workloads=["fp8_linear_m1"],
        recipes=[],
        echo=printed.append,
    )
    assert lines[0]["size"] == "quick" and lines[0]["workload_size"] == "test" and lines[0]["processes"] == 1
    assert [x["size"] for x in lines if x["kind"] == "workload"] == ["test"]
    assert lines[0]["repeats"] == 1 and lines[0]["budget_s"] == selftest.run.CPU_BUDGET_S < selftest.BUDGET_S["quick"]
    assert any("run at their test size" in ln for ln in printed), printed
    assert printed[-1].endswith("not evidence: do not send them"), printed[-1]
    assert validate(jsonl)["workloads"] == {"fp8_linear_m1": "pass"}
