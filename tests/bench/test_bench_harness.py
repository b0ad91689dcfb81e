"""mpsboost.bench.harness: the parts every benchmark shares."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from mpsboost.bench import TimingError, copy_bandwidth, count_pad5d, measure_variants
from mpsboost.bench.harness import verdict
from mpsboost.bench.timing import _summarise


def test_pad_counter_counts_every_route_to_a_5d_pad_and_nothing_else():
    x = torch.randn(1, 2, 3, 4, 5)
    with count_pad5d() as c:
        F.pad(x, (1, 1, 1, 1, 1, 1))
        torch.nn.ZeroPad3d(1)(x)
        torch.ops.aten.constant_pad_nd(x, [0, 0, 0, 0, 2, 0])  # a direct aten call: patching F.pad misses it
        F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate")
        F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect")
        F.pad(x[0], (1, 1, 1, 1))  # rank 4: not counted
        torch.cat([x, x], dim=2)  # not a pad
    assert c.by_op == {"constant_pad_nd": 3, "replication_pad3d": 1, "reflection_pad3d": 1}
    assert c.total == 5 and c.to_dict()["total"] == 5


def test_pad_counter_sees_nothing_outside_its_block():
    x = torch.randn(1, 1, 2, 2, 2)
    with count_pad5d() as c:
        pass
    F.pad(x, (1, 1))
    assert c.total == 0


def test_measure_variants_alternates_and_rotates_the_start():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("stock", "a", "b")}
    m = measure_variants(fns, device="cpu", repeats=6, warmup=0, calls=1)
    assert calls[:3] == ["stock", "a", "b"] and calls[3:6] == ["a", "b", "stock"] and calls[6:9] == ["b", "stock", "a"]
    assert set(m.timings) == {"stock", "a", "b"} and all(t.repeats == 6 for t in m.timings.values())


def test_measure_variants_flags_a_busy_machine_and_refuses_too_few_repeats():
    state = {"i": 0}

    def jumpy():
        state["i"] += 1
        time.sleep(0.004 if state["i"] % 2 else 0.0005)

    m = measure_variants({"stock": lambda: time.sleep(0.001), "jumpy": jumpy}, device="cpu", repeats=6, warmup=0)
    assert m.busy and m.worst_spread > m.busy_spread
    assert m.extra("jumpy")["busy_machine"] is True
    with pytest.raises(TimingError, match=">= 5"):
        measure_variants({"stock": lambda: None}, device="cpu", repeats=3)


def test_verdict_needs_the_spreads_apart():
    a = _summarise([1.0, 1.1, 1.2], calls=1, warmup=0, method="t")
    b = _summarise([0.5, 0.6, 0.7], calls=1, warmup=0, method="t")
    c = _summarise([0.9, 1.05, 1.3], calls=1, warmup=0, method="t")
    assert verdict(a, b) == "faster" and verdict(b, a) == "slower" and verdict(a, c) == "no difference"


def test_copy_bandwidth_is_none_on_cpu():
    assert copy_bandwidth("cpu") is None


@pytest.mark.cuda
def test_copy_bandwidth_on_cuda_is_plausible():
    bw = copy_bandwidth("cuda", nbytes=1 << 26)
    assert 1e10 < bw < 1e13


@pytest.mark.cuda
def test_measure_variants_with_cuda_graphs():
    x = torch.randn(1024, 1024, device="cuda")
    m = measure_variants(
        {"stock": lambda: x @ x, "half": lambda: x[:512] @ x}, device="cuda", repeats=5, calls=4, cuda_graph=True
    )
    assert m.timings["stock"].method == "cuda_graph" and m.ratio("half") > 1.0


def test_contexts_hold_each_variant_in_its_state_outside_the_timing():
    log: list[str] = []
    state = {"on": False}

    import contextlib

    @contextlib.contextmanager
    def patched():
        state["on"] = True
        log.append("enter")
        yield
        state["on"] = False
        log.append("exit")

    seen = {"stock": set(), "patched": set()}
    fns = {"stock": lambda: seen["stock"].add(state["on"]), "patched": lambda: seen["patched"].add(state["on"])}
    measure_variants(fns, device="cpu", repeats=5, warmup=1, contexts={"patched": patched})
    assert seen == {"stock": {False}, "patched": {True}}
    assert log.count("enter") == log.count("exit") == 6  # one warm-up block and five samples
    with pytest.raises(TimingError, match="not measured"):
        measure_variants(fns, device="cpu", repeats=5, contexts={"other": patched})


def test_ratio_range_spans_the_two_spreads():
    from mpsboost.bench import OpTime, Throughput
    from mpsboost.bench.plot import ratio_range

    a = OpTime(median_us=10.0, min_us=9.0, max_us=12.0)
    b = OpTime(median_us=5.0, min_us=4.0, max_us=6.0)
    assert ratio_range(a, b) == (9.0 / 6.0, 12.0 / 4.0)
    t1 = Throughput(value=1.0, unit="s/call", spread={"min_s": 0.9, "max_s": 1.1})
    t2 = Throughput(value=1.0, unit="s/call", spread={})
    assert ratio_range(t1, t2) is None


# ------------------------------------------------------------------------------------------ measure_job


def _counting_job():
    """A job that records each call's index in the log it returns, and the log."""
    log: list[int] = []

    def job():
        log.append(len(log))
        return torch.full((2,), float(len(log)))

    return job, log


def test_measure_job_output_first_then_warmups_repeats_ops_and_a_separate_memory_pass():
    from mpsboost.bench.harness import measure_job

    job, log = _counting_job()
    op_calls: list[int] = []
    seen: list[str] = []

    @__import__("contextlib").contextmanager
    def watcher():
        seen.append("in")
        yield
        seen.append("out")

    m = measure_job(
        job,
        device="cpu",
        repeats=3,
        warmup=2,
        output="first",
        memory="last",
        watch=(watcher,),
        ops=lambda: {"op": lambda: op_calls.append(1)},
        op_warmup=1,
        op_repeats=5,
    )
    # output call + 2 warm-ups + 3 timed + 1 memory pass; the output is the first call's
    assert len(log) == 1 + 2 + 3 + 1
    assert m.output.tolist() == [1.0, 1.0]
    assert seen == ["in", "out"]  # the watchers wrap the output call only
    assert m.timing.repeats == 3 and m.timing.warmup == 2 and m.timing.method == "perf_counter"
    assert len(op_calls) == 1 + 5 and m.op_timings["op"].repeats == 5
    assert m.memory is not None and m.memory.driver_level > 0
    assert m.first_call_s is not None and m.first_call_s >= 0


def test_measure_job_takes_the_output_from_the_memory_pass_when_asked():
    from mpsboost.bench.harness import measure_job

    job, log = _counting_job()
    m = measure_job(job, device="cpu", repeats=2, warmup=1, output="last", memory="last")
    assert len(log) == 1 + 2 + 1 and m.output.tolist() == [4.0, 4.0] and m.first_call_s is None


def test_measure_job_memory_first_is_the_output_call():
    from mpsboost.bench.harness import measure_job

    job, log = _counting_job()
    m = measure_job(job, device="cpu", repeats=2, warmup=0, output="first", memory="first")
    assert len(log) == 1 + 2 and m.output.tolist() == [1.0, 1.0] and m.memory is not None


def test_measure_job_caps_the_repeats_of_a_long_call():
    from mpsboost.bench.harness import measure_job

    def slow():
        time.sleep(0.05)

    m = measure_job(slow, device="cpu", repeats=10, warmup=1, output=None, memory=None, time_cap_s=0.12)
    assert 1 <= m.timing.repeats <= 3 and m.output is None and m.memory is None


def test_measure_job_refuses_passes_that_contradict_each_other():
    from mpsboost.bench.harness import measure_job

    with pytest.raises(TimingError, match="'first', 'last' or None"):
        measure_job(lambda: None, device="cpu", repeats=1, output="middle")
    with pytest.raises(TimingError, match="memory='first' measures the output call"):
        measure_job(lambda: None, device="cpu", repeats=1, output="last", memory="first")
    with pytest.raises(TimingError, match="output='last' takes the output from the memory pass"):
        measure_job(lambda: None, device="cpu", repeats=1, output="last", memory=None)


def test_one_busy_threshold_and_one_best_device_for_every_entry_point():
    import mpsboost.demo as demo
    from mpsboost.bench import cli, harness

    assert demo.BUSY_SPREAD is harness.BUSY_SPREAD and demo.ratio_lines is harness.ratio_lines
    assert cli.best_device is harness.best_device
    assert harness.best_device() in ("mps", "cuda", "cpu")


def test_frozen_heap_freezes_what_lives_on_entry_collects_what_is_made_within_and_hands_back():
    import gc
    import weakref

    from mpsboost.bench.harness import frozen_heap, release

    class Node:
        pass

    assert gc.get_freeze_count() == 0, "a frozen heap left over from another test"
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the imported libraries' objects, at least
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made within: garbage only the collector frees
        ref = weakref.ref(a)
        del a, b
        release("cpu")
        assert ref() is None, "garbage made within the frozen heap was not collected"
        with frozen_heap():  # nested: the outer one keeps the freezing (frozen objects freed meanwhile leave it)
            assert frozen - 100 < gc.get_freeze_count() <= frozen
        assert frozen - 100 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own freeze is the caller's to undo
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
