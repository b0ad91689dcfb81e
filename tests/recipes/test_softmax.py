"""softmax: the sampling step of generate() keeps exactly the stock distribution, without host syncs.

Distribution: chi-square tests of many draws against the stock probabilities (fixed significance),
and token-for-token identity with stock generate() under the same seed. Plans per env, unpatch
identity, the deferred NaN check, pickling.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from unittest import mock

import pytest
import torch
from torch import nn

import mpsboost
from mpsboost.ops.sampling import DeferredCheck, draw, draw_from_logits
from mpsboost.recipes._hf_sample import with_globals
from transformers.generation.utils import GenerationMixin

from tiny_models import build, generate

ALPHA = 1e-6  # significance of each chi-square test; fresh random distributions every run
DRAWS = 40_000


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def _logits(vocab: int, masked: int = 0) -> torch.Tensor:
    x = torch.randn(vocab, dtype=torch.float64).float()
    if masked:
        x[torch.randperm(vocab)[:masked]] = float("-inf")  # as top-k / top-p leave them
    return x


@pytest.mark.parametrize("form", ["probs", "logits"])
@pytest.mark.parametrize("masked", [0, 10])
def test_draws_follow_the_stock_distribution(form, masked, rng_seed):
    vocab = 40
    logits = _logits(vocab, masked)
    probs = torch.softmax(logits, dim=-1)
    rows = logits.expand(DRAWS, vocab).contiguous()
    if form == "probs":
        tokens, winners = draw(torch.softmax(rows, dim=-1))
        assert bool((winners > 0).all())
    else:
        tokens, winners = draw_from_logits(rows)
        assert bool(torch.isfinite(winners).all())
    assert tokens.shape == (DRAWS, 1) and tokens.dtype == torch.int64
    counts = torch.bincount(tokens.flatten(), minlength=vocab)
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a masked (-inf) token was drawn"
    p = _chi2_pvalue(counts[support], probs[support])
    assert p > ALPHA, f"chi-square p={p:.2e} for {form} draws (seed {rng_seed})"


def test_stock_multinomial_passes_the_same_test(rng_seed):
    """The test has power: stock passes, a slightly wrong distribution fails."""
    vocab = 40
    probs = torch.softmax(_logits(vocab), dim=-1)
    counts = torch.bincount(torch.multinomial(probs, DRAWS, replacement=True), minlength=vocab)
    assert _chi2_pvalue(counts, probs) > ALPHA
    # Move 1% of the mass from the likeliest token to the least likely one. The chi-square
    # noncentrality is DRAWS * 0.01**2 * (1/p_max + 1/p_min) >= 160, because p_min <= 1/vocab: the
    # statistic's mean is then >= 199 against a 1e-6 threshold near 95, whatever the seed. (Adding 2%
    # to the likeliest token alone had too little power when that token held a third of the mass.)
    skewed = probs.clone()
    skewed[probs.argmax()] -= 0.01
    skewed[probs.argmin()] += 0.01
    wrong = torch.bincount(torch.multinomial(skewed, DRAWS, replacement=True), minlength=vocab)
    assert _chi2_pvalue(wrong, probs) < ALPHA


def test_same_generator_state_same_token_as_multinomial(rng_seed):
    probs = torch.softmax(_logits(1000) * 3, dim=-1).expand(4, 1000).contiguous()
    for i in range(20):
        torch.manual_seed(rng_seed + i)
        stock = torch.multinomial(probs, num_samples=1)
        torch.manual_seed(rng_seed + i)
        ours, _ = draw(probs)
        assert torch.equal(stock, ours)


def test_deferred_check_flags_what_multinomial_rejects():
    ok = DeferredCheck()
    ok.add(draw(torch.softmax(torch.randn(3, 50), -1))[1])
    assert ok.ok()
    for bad in (float("nan"), float("inf")):
        probs = torch.softmax(torch.randn(3, 50), -1)
        probs[1, 7] = bad
        with pytest.raises(RuntimeError, match="inf"):
            torch.multinomial(probs, 1)
        c = DeferredCheck()
        c.add(draw(probs)[1])
        assert not c.ok()
        with pytest.raises(RuntimeError, match="nan"):
            c.check()
    logits = torch.randn(2, 50)
    logits[0, 3] = float("nan")
    c = DeferredCheck()
    c.add(draw_from_logits(logits)[1], logits_form=True)
    assert not c.ok()


# ------------------------------------------------------------------------------ the recipe


@pytest.fixture
def lm():
    return build("qwen3").eval()


def test_plan_per_env(lm):
    expect = {
        ("mps", "2.14.1"): ("draw on logits", "pytorch#196071"),
        ("mps", "2.15.0"): ("native softmax", "pytorch#196071"),
        ("mps", "2.16.0.dev20261201"): ("native softmax", "host reads per sampled token"),
        ("cpu", "2.13.0"): ("native softmax", "host reads per sampled token"),
    }
    # CUDA: the whole generate() measured on the H200 decides (stock kept there); other GPUs keep stock too.
    skipped = {
        ("cuda", "2.11.0"): "no end-to-end gain measured: whole generate()",
        ("cuda:8.0", "2.11.0"): "softmax_sampling was measured on NVIDIA H200 (sm_90)",
    }
    for (dev, tv), why in skipped.items():
        rows = mpsboost.plan(lm, device=dev, torch_version=tv, recipes=["softmax"]).rows
        assert len(rows) == 1 and rows[0].status == "skipped" and why in rows[0].reason, (dev, tv, rows[0])
    for (dev, tv), (backing, why) in expect.items():
        rows = mpsboost.plan(lm, device=dev, torch_version=tv, recipes=["softmax"]).rows
        assert len(rows) == 1 and rows[0].target == "<root>"
        assert rows[0].status == "would apply" and rows[0].backing.startswith(backing) and why in rows[0].reason, (
            dev,
            tv,
            rows[0],
        )


def test_reason_counts_host_reads_against_the_stock_loop(lm):
    """transformers 5.23+ defers generate()'s stop check on MPS (DeferredStopCheck), so there the stock
    loop reads 2 values per token (torch.multinomial's check) and the patched one 0; elsewhere the stop
    check still reads one per token: 3 stock, 1 patched. Counted from the installed loop's source."""
    from mpsboost.recipes.softmax import host_reads_per_token

    sample = type(lm)._sample
    deferred = "DeferredStopCheck.is_supported(" in inspect.getsource(sample)
    assert host_reads_per_token(sample, "mps") == ((2, 0) if deferred else (3, 1))
    assert host_reads_per_token(sample, "cuda") == (3, 1)
    mps = mpsboost.plan(lm, device="mps", torch_version="2.15.0", recipes=["softmax"]).rows[0]
    cpu = mpsboost.plan(lm, device="cpu", torch_version="2.13.0", recipes=["softmax"]).rows[0]
    assert "3 stock" in cpu.reason and "1 patched" in cpu.reason and "stop check still reads one" in cpu.reason
    if deferred:  # transformers >= 5.23
        assert "2 stock" in mps.reason and "0 patched" in mps.reason and "DeferredStopCheck" in mps.reason
    # a loop without the deferred check (transformers < 5.23) counts the stop check's read on MPS too

    def _sample(self):
        probs = nn.functional.softmax(next_token_scores, dim=-1)  # noqa: F821
        return torch.multinomial(probs, num_samples=1)

    assert host_reads_per_token(_sample, "mps") == (3, 1)


@pytest.mark.parametrize("path", ["probs", "logits"])
def test_generate_same_tokens_as_stock(lm, path, rng_seed):
    def sample():
        torch.manual_seed(rng_seed)
        return generate(lm, rng_seed, batch=3, prompt=4, new_tokens=12, do_sample=True)

    stock = sample()
    mpsboost.patch(lm, recipes=["softmax"], options={"softmax": {"path": path}})
    try:
        # The stock draw is never called: the patched step does its own (sync-free) draw.
        with mock.patch("torch.multinomial", side_effect=AssertionError("torch.multinomial was called")):
            ours = sample()
        greedy_patched = generate(lm, rng_seed, do_sample=False)
    finally:
        mpsboost.unpatch(lm)
    if path == "probs":
        assert torch.equal(ours, stock)  # same exponential_ calls: the very same tokens
    else:
        # Gumbel-max on logits: same distribution; same tokens except where rounding flips a near tie.
        assert (ours == stock).float().mean() > 0.9
    assert torch.equal(greedy_patched, generate(lm, rng_seed, do_sample=False))


def test_logits_path_computes_no_softmax(lm, rng_seed):
    mpsboost.patch(lm, recipes=["softmax"], options={"softmax": {"path": "logits"}})
    try:
        with mock.patch("torch.nn.functional.softmax", side_effect=AssertionError("softmax was computed")):
            out = generate(lm, rng_seed, new_tokens=5, do_sample=True)
        assert out.shape[1] == 5 + 5
    finally:
        mpsboost.unpatch(lm)


def test_nan_scores_still_raise(lm, rng_seed):
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

    class Poison(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, 5] = float("nan")
            return scores

    ids = torch.randint(3, 128, (2, 4))
    kw = dict(max_new_tokens=3, do_sample=True, pad_token_id=0, logits_processor=LogitsProcessorList([Poison()]))
    with pytest.raises(RuntimeError, match="nan"):
        lm.generate(ids, **kw)
    mpsboost.patch(lm, recipes=["softmax"])
    try:
        with pytest.raises(RuntimeError, match=r"nan.*found after generation"):
            lm.generate(ids, **kw)
    finally:
        mpsboost.unpatch(lm)


def test_unpatch_restores_class_and_sample(lm):
    cls = type(lm)
    assert cls._sample is GenerationMixin._sample
    report = mpsboost.patch(lm, recipes=["softmax"])
    assert report.by_status("applied")
    assert type(lm) is not cls and isinstance(lm, cls) and type(lm).__name__ == cls.__name__
    assert type(lm)._sample is not GenerationMixin._sample
    assert mpsboost.patch(lm, recipes=["softmax"]).note.startswith("nothing changed")
    mpsboost.unpatch(lm)
    assert type(lm) is cls and type(lm)._sample is GenerationMixin._sample
    assert "_mpsboost_patches" not in lm.__dict__


def test_copies_of_a_patched_model_are_plain(lm):
    cls = type(lm)
    mpsboost.patch(lm, recipes=["softmax"])
    try:
        for other in (copy.deepcopy(lm), pickle.loads(pickle.dumps(lm))):
            assert type(other) is cls and "_mpsboost_patches" not in other.__dict__
            assert torch.equal(other.lm_head.weight, lm.lm_head.weight)
    finally:
        mpsboost.unpatch(lm)


def test_unknown_sampling_step_is_left_alone(lm):
    cls = type(lm)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kw):
        probs = torch.softmax(torch.zeros(1, 4), -1)
        return torch.multinomial(probs, 2)

    odd = type(cls.__name__, (cls,), {"_sample": _sample})
    lm.__class__ = odd
    try:
        rows = mpsboost.plan(lm, recipes=["softmax"]).rows
        assert rows[0].status == "skipped" and "left alone" in rows[0].reason
    finally:
        lm.__class__ = cls


def test_with_globals_leaves_the_original_untouched():
    def f(x):
        return torch.multinomial(x, 1)

    g = with_globals(f, {"torch": mock.Mock(multinomial=lambda x, n: "proxied")})
    assert g(torch.ones(3)) == "proxied"
    assert f(torch.ones(3)).shape == (1,)
    assert g.__code__ is f.__code__ and f.__globals__ is globals()
