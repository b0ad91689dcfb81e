"""The mutation check: break what a test guards, on purpose, and see that test go red.

Each mutation below names a file of the tree, an exact piece of its text and what to put instead, and the
tests that must fail once it is applied. For each one asked for, this script copies the tree (the files
git tracks, plus untracked ones it does not ignore) into a temporary folder, applies the mutation there
(the checkout itself is never touched), runs those tests with that copy's ``src/`` first on the path,
and expects them to fail. A mutation whose text is no longer in its file is reported as stale (the code
moved: update the mutation). Before any test runs, every entry of the list (not only those asked for) is
applied in memory: one that no longer matches its file stops the run at once, naming the entry, the file
and the text it looks for. Exit status 0 when every mutation run was caught, 1 when one survived, errored
or is stale, 2 for a usage error.

    python tools/mutations.py              # every mutation
    python tools/mutations.py leak         # those whose name contains "leak"
    python tools/mutations.py --quick      # the quick set (quick=True), the one CI runs (.ci/run)
    python tools/mutations.py --check      # every entry still matches its file; no test run
    python tools/mutations.py --list       # names, files and tests, nothing run

It runs pytest in the current Python environment (the one the README's test command sets up).
tests/core/test_mutations_tool.py runs the ``--check`` step with the other tests.

The entry format (one ``Mutation(...)`` per entry in MUTATIONS; add entries, keep the fields):

    Mutation(
        name="recipe-what-breaks",          # unique, lowercase words joined by "-"
        why="what the mutation breaks, in words",
        edits=(Edit("src/mpsboost/...py", "exact old text, found once\n", "its replacement\n"),),
        tests=("tests/path/test_x.py", "-k", "expr"),   # pytest arguments that must go red
        quick=True,                         # optional (default False): in the quick set CI runs
    )

``Edit.old == ""`` appends ``new`` to the file. Several edits of one entry apply in order. A quick entry's
tests take seconds (the quick set runs in CI after the test suite, in about three minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str  # exact text, found exactly once
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # what the mutation breaks, in words
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest arguments (paths, -k expressions)
    quick: bool = False  # in the quick set (--quick; CI runs it): tests that take seconds


# A module-level list that keeps every patched layer alive: the leak the leak tests exist for. The list
# is defined at the end of the module; apply() looks it up when it runs.
_LEAK_LIST = "\n\n_MPSBOOST_MUTANT_KEEP: list = []  # mutation: a module-level list holding patched layers\n"


def _leak(recipe: str, signature: str, quick: bool = False) -> Mutation:
    path = f"src/mpsboost/recipes/{recipe}.py"
    body = f"{signature}\n        _MPSBOOST_MUTANT_KEEP.append(match.module)\n"
    return Mutation(
        name=f"leak-append-{recipe.replace('_', '-')}",
        why=f"{recipe}.apply appends each patched layer to a module-level list (a dropped model's layers stay alive)",
        edits=(Edit(path, f"{signature}\n", body), Edit(path, "", _LEAK_LIST)),
        tests=("tests/core/test_leaks.py", "-m", "not slow", "-k", recipe),
        quick=quick,
    )


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="call-original-type-forward",
        why="call_original resolves type(module).forward inside traced code (dynamo cannot trace diffusers' Attention)",
        edits=(
            Edit(
                "src/mpsboost/patching.py",
                'return entry["class_forward"](module, *args, **kwargs)',
                "return type(module).forward(module, *args, **kwargs)",
            ),
        ),
        tests=("tests/core/test_patch_primitive.py", "-k", "in_graph"),
    ),
    Mutation(
        name="affine-quantize-in-the-callers-weight",
        why="affine_quantize computes its codes in place in a float32 weight it was given, not in a copy",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_codec.py",
                "g = g.float() if g.dtype != torch.float32 else g.clone()",
                "g = g.float()",
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "bit_for_bit"),
    ),
    Mutation(
        name="selftest-release-over-the-whole-heap",
        why="the selftest runs without its frozen heap: each probe's and workload's gc.collect() walks the libraries",
        edits=(
            Edit(
                "src/mpsboost/selftest/run.py",
                "    with frozen_heap():  # each probe",
                "    with __import__('contextlib').nullcontext():  # each probe",
            ),
        ),
        tests=("tests/integration/test_selftest.py", "-k", "frozen_heap"),
        quick=True,
    ),
    Mutation(
        name="frozen-heap-unfreezes-a-callers-freeze",
        why="frozen_heap freezes and unfreezes even under a caller's own gc.freeze(), undoing it",
        edits=(
            Edit(
                "src/mpsboost/bench/harness.py",
                "    if gc.get_freeze_count():\n        yield\n",
                "    if False:\n        yield\n",
            ),
        ),
        tests=("tests/bench/test_bench_harness.py", "-k", "frozen_heap"),
        quick=True,
    ),
    Mutation(
        name="attention-split-walk-per-module",
        why="attention_split's find walks the whole model again for every module a match covers (quadratic plan())",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_split.py",
                "            if id(mod) in covered:",
                "            if id(mod) in covered and any(x is mod for x in root.modules()):",
            ),
        ),
        tests=("tests/core/test_plan_scaling.py",),
    ),
    Mutation(
        name="attn-metal-no-barrier-before-the-rotation",
        why="the fused attention kernel rotates from threadgroup memory before every lane has written its normed row",
        edits=(
            Edit(
                "src/mpsboost/ops/attn_metal.py",
                "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  device const XT* cr",
                "  device const XT* cr",
            ),
        ),
        tests=("tests/ops/test_attn_metal_emulated.py", "-k", "gated-b1"),
    ),
    Mutation(
        name="attn-metal-rotate-half-sign",
        why="the fused attention kernel's rotate_half loses its negation on the first half",
        edits=(Edit("src/mpsboost/ops/attn_metal.py", "e < hr ? -buf[e + hr]", "e < hr ? buf[e + hr]"),),
        tests=("tests/ops/test_attn_metal_emulated.py", "-k", "gated-b1"),
    ),
    Mutation(
        name="attn-metal-cache-position",
        why="the fused attention kernel writes K/V one position past pos[0]",
        edits=(Edit("src/mpsboost/ops/attn_metal.py", "* S + p) * D + e;", "* S + p + 1) * D + e;"),),
        tests=("tests/ops/test_attn_metal_emulated.py", "-k", "gated-b1"),
    ),
    Mutation(
        name="quant-norm-plus-one-kept",
        why="from_pretrained keeps Qwen3.5's zero-centred norms as mlx-lm stored them (+1), not undone",
        edits=(
            Edit(
                "src/mpsboost/quant/formats.py",
                "            t = t.float() - 1.0  # transformers computes x * (1 + w): mlx-lm stored 1 + w\n",
                "            t = t.float()\n",
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "every_family and qwen3_5_moe"),
    ),
    Mutation(
        name="quant-gate-up-swapped",
        why="the experts' switch_mlp stacks fused up rows first (transformers' gate_up_proj holds gate rows first)",
        edits=(
            Edit(
                "src/mpsboost/quant/formats.py",
                '("gate_up_proj", ("gate_proj", "up_proj"), up_key)',
                '("gate_up_proj", ("up_proj", "gate_proj"), up_key)',
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "every_family and mixtral"),
    ),
    Mutation(
        name="low-bit-dequant-bias-dropped",
        why="the low-bit layers dequantise as scales * q, without the group biases",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "return affine_dequantize(q, scales.float(), biases.float(), p.bits, p.group_size, dtype)",
                "return affine_dequantize(q, scales.float(), biases.float() * 0, p.bits, p.group_size, dtype)",
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "every_family and qwen3_5_moe"),
    ),
    Mutation(
        name="low-bit-decode-routing-weights-dropped",
        why="the low-bit experts' decode path sums the top-k experts' outputs without their routing weights",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "    return (o.view(t, k, -1) * wts.unsqueeze(-1).to(o.dtype)).sum(1)\n",
                "    return o.view(t, k, -1).sum(1)\n",
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "layers_alone and olmoe"),
    ),
    Mutation(
        name="low-bit-prefill-weights-unsorted",
        why="the low-bit experts' prefill path weights each routed pair by another pair's routing weight",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "        o = F.linear(a, dn) * wsorted[start : start + n].unsqueeze(-1).to(dtype)\n",
                "        o = F.linear(a, dn) * wts.reshape(-1)[start : start + n].unsqueeze(-1).to(dtype)\n",
            ),
        ),
        tests=("tests/quant/test_mlx_affine.py", "-k", "layers_alone and qwen3_moe"),
    ),
    Mutation(
        name="quant-save-norm-not-plus-one",
        why="save_mlx writes Qwen3.5's zero-centred norms as transformers holds them (mlx-lm reads them +1)",
        edits=(Edit("src/mpsboost/quant/save.py", "t = (t.float() + 1.0).to(t.dtype)", "t = t.float().to(t.dtype)"),),
        tests=("tests/quant/test_quantize_save.py", "-k", "saved_folder and qwen3_5_moe"),
    ),
    Mutation(
        name="quant-save-gate-up-halves-swapped",
        why="save_mlx writes the up rows of gate_up_proj as switch_mlp.gate_proj",
        edits=(
            Edit(
                "src/mpsboost/quant/save.py",
                'parts = [("gate_proj", 0), ("up_proj", 1)]',
                'parts = [("gate_proj", 1), ("up_proj", 0)]',
            ),
        ),
        tests=("tests/quant/test_quantize_save.py", "-k", "saved_folder and mixtral"),
    ),
    Mutation(
        name="affine-codes-unpacked-high-bits-first",
        why="the uint8 unpacking of 2- and 4-bit codes reads a byte's codes from its high bits down",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_codec.py",
                "        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)\n",
                "        shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=q.device)\n",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "equal_mlx_bit_for_bit and bfloat16"),
        quick=True,
    ),
    Mutation(
        name="affine-codes-packed-one-code-short",
        why="the uint8 packing of 2-, 4- and 8-bit codes ORs one code fewer into each byte",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_codec.py",
                "        for j in range(1, 8 // bits):\n",
                "        for j in range(1, 8 // bits - 1):\n",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "equal_mlx_bit_for_bit and bfloat16"),
    ),
    Mutation(
        name="affine-metal-decode-shift",
        why="the Metal low-bit kernels cut codes at the wrong shift within a word (o & 15 for o & 31)",
        edits=(Edit("src/mpsboost/ops/affine_metal.py", "  const int sh = o & 31;\n", "  const int sh = o & 15;\n"),),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "decodes_exactly"),
    ),
    Mutation(
        name="affine-metal-straddle-dropped",
        why="the Metal low-bit kernels drop the high bits of a code that straddles two words (3, 5, 6 bits)",
        edits=(Edit("src/mpsboost/ops/affine_metal.py", "    v |= words.w[w + 1] << (32 - sh);\n", ""),),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "decodes_exactly"),
    ),
    Mutation(
        name="affine-metal-group-index",
        why="the Metal GEMV reads the scale and bias of the wrong group along K (k >> (gsh + 1))",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_metal.py",
                "    const long kg = k >> gsh;\n",
                "    const long kg = k >> (gsh + 1);\n",
            ),
        ),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "dense_matches_reference"),
    ),
    Mutation(
        name="affine-metal-scale-index-expert",
        why="the Metal grouped GEMV reads expert 0's scales for every expert (n * G for row * G)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_metal.py",
                "          s = mpsb_sb(sc, row * G + kg, st);\n",
                "          s = mpsb_sb(sc, n * G + kg, st);\n",
            ),
        ),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "grouped_empty_experts"),
    ),
    Mutation(
        name="affine-metal-offset-search",
        why="the Metal grouped GEMV's binary search puts a row at an expert's end into that expert (<= for <)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_metal.py",
                "    if (r < long(offs[mid])) {{\n",
                "    if (r <= long(offs[mid])) {{\n",
            ),
        ),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "grouped_empty_experts"),
    ),
    Mutation(
        name="affine-metal-row-bound",
        why="the Metal GEMV writes rows past R (the last threadgroup's missing rows): out of the output's bounds",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_metal.py",
                "      if (lane == 0 && n < N && r < R) {{\n",
                "      if (lane == 0 && n < N) {{\n",
            ),
        ),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "dense_matches_reference and b4"),
    ),
    Mutation(
        name="affine-metal-embedding-id-bound",
        why="the Metal gather reads the row of an id past the table (no upper bound check)",
        edits=(Edit("src/mpsboost/ops/affine_metal.py", "  if (id < 0 || id >= V) {{\n", "  if (id < 0) {{\n"),),
        tests=("tests/ops/test_affine_metal_emulated.py", "-k", "out_of_range"),
    ),
    Mutation(
        name="affine-quantize-bias-always-edge",
        why="affine_quantize keeps the edge as the bias when it rounds to code 0 (mx.quantize's bias is then 0)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_codec.py",
                "    bias = torch.where(nz, edge, torch.zeros_like(edge))\n",
                "    bias = edge\n",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "equal_mlx_bit_for_bit"),
        quick=True,
    ),
    Mutation(
        name="affine-unpack-code-order",
        why="unpack_codes reads the eight codes of a run in reverse (big-endian within the run)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine_codec.py",
                "    shifts = bits * torch.arange(8, device=q.device)\n",
                "    shifts = bits * torch.arange(8, device=q.device).flip(0)\n",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "equal_mlx_bit_for_bit"),
        quick=True,
    ),
    Mutation(
        name="affine-grouped-reference-offset-search",
        why="the grouped reference puts a row at an expert's end into that expert (searchsorted right=False)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine.py",
                "    return torch.searchsorted(offsets, rows, right=True)\n",
                "    return torch.searchsorted(offsets, rows)\n",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "gather_qmm"),
        quick=True,
    ),
    Mutation(
        name="affine-int4pack-zero-unshifted",
        why="to_int4pack passes the bias as int4pack's zero (it computes (q - 8) * scale + zero: bias + 8 scale)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine.py",
                '    zero = biases.to("cpu", torch.float64) + 8.0 * s\n',
                '    zero = biases.to("cpu", torch.float64)\n',
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "int4pack_conversion"),
        quick=True,
    ),
    _leak(
        "linear_attention",
        "    def apply(self, match: Match, decision: Decision, env: Env, options: LinearAttentionOptions) -> Patch:",
        quick=True,
    ),
    _leak(
        "moe_experts",
        "    def apply(self, match: Match, decision: Decision, env: Env, options: MoeExpertsOptions) -> Patch:",
    ),
    Mutation(
        name="moe-block-router-never-run",
        why="moe_block's decode path never runs the router module: output_router_logits records nothing (IndexError)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "    observed = _router_observed(self.gate)\n",
                "    observed = False\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "aux_loss_equal and (mixtral or qwen2_moe)"),
    ),
    Mutation(
        name="moe-block-router-run-for-idle-capture-hooks",
        why="moe_block runs the router at every decode step once transformers' capture hooks exist (ops added)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                '    return wanted is not None and "router_logits" in wanted\n',
                "    return True\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "keeps_its_ops and mixtral"),
    ),
    Mutation(
        name="moe-block-router-output-not-routed",
        why="moe_block runs a hooked router but routes by its own top-k, not by what the router returned",
        edits=(
            Edit("src/mpsboost/recipes/moe_block.py", "        routing = (scores, ids)\n", "        routing = None\n"),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "users_router_hook and mixtral"),
    ),
    Mutation(
        name="moe-block-down-weights-unchecked",
        why="moe_block's grouped_mm check of its weights reads the up weights only (down rows of 8 bytes reach it)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "        gu.new_empty((1, lay.hidden)), state.weights.gate_up_kn, state.weights.down_kn\n",
                "        gu.new_empty((1, lay.hidden)), state.weights.gate_up_kn\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "dtype_change"),
    ),
    Mutation(
        name="grouped-mm-widths-mps-unchecked",
        why="grouped_mm_widths_ok lets MPS take rows that are not a multiple of 16 bytes (the kernel's check raises)",
        edits=(
            Edit(
                "src/mpsboost/ops/moe.py",
                '    if device_type in ("cpu", "mps"):\n        dev = device_type.upper()\n',
                '    if device_type == "cpu":\n        dev = device_type.upper()\n',
            ),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "holds_mps or (cannot_take and olmoe)"),
        quick=True,
    ),
    Mutation(
        name="native-grouped-mm-ok-ignores-down-weights",
        why="native_grouped_mm_ok checks x and the up weights, not the down weights it is given",
        edits=(
            Edit(
                "src/mpsboost/ops/moe.py",
                "        for t in (x, weight_kn, *more_kn):\n",
                "        for t in (x, weight_kn):\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_router_logits.py", "-k", "reads_the_down_weights"),
        quick=True,
    ),
    Mutation(
        name="mask-multiply-pass-linear-attention",
        why="the patched Gated DeltaNet forward no longer zeroes padded positions (attention mask ignored)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)\n",
                "        pass\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py",),
    ),
    Mutation(
        name="deltanet-decode-uncounted",
        why="the patched decode step no longer counts its token in the cache (transformers >= 5.25 reads the "
        "sequence length from a linear layer: positions stall and the attention layers drift from stock)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "                cache.increase_count(self.layer_idx, 0)\n",
                "                pass\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "in_place"),
        quick=True,
    ),
    Mutation(
        name="deltanet-recording-multi-token-not-stock",
        why="a multi-token step on a cache recording the past (assisted decoding) no longer runs stock: it keeps one "
        "intermediate state, and crop() rolls back to the wrong one",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "    stock = stock or (recording and s != 1)\n",
                "    stock = stock\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "recording"),
    ),
    Mutation(
        name="deltanet-recorded-step-in-place",
        why="a one-token step on a recording cache writes into the cache's own conv state where the slice is all of "
        "it (the cache then appends the new column to a rolled state)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "        window = window.clone(memory_format=torch.contiguous_format)\n",
                "        window = window.contiguous()\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "assistant"),
    ),
    Mutation(
        name="deltanet-recorded-state-not-recorded",
        why="a one-token step on a recording cache writes its new state into the cache's tensor instead of handing "
        "it to update_recurrent_state: the state before it is not kept, and generate()'s deferred stop check on a "
        "Mac crops back to the wrong one",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "conv_kernel_size=lay.width)\n    cache.update_recurrent_state(state, mod.layer_idx)\n",
                "conv_kernel_size=lay.width)\n    rec.copy_(state)\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "deferred"),
    ),
    Mutation(
        name="doctor-hub-kernels-not-read-from-transformers",
        why="mpsboost doctor lists every Metal hub kernel it knows, not those the installed transformers names "
        "(5.25 no longer maps RMSNorm on mps to mlx-rmsnorm)",
        edits=(
            Edit(
                "src/mpsboost/cli.py",
                "                    named = repo in f.read()\n",
                "                    named = True\n",
            ),
        ),
        tests=("tests/core/test_cli.py", "-k", "hub"),
    ),
    Mutation(
        name="vae-dense-inputs-off",
        why="under Mac decisions a folded VAE convolution gets a strided frame slice at batch > 1 (pytorch#169342)",
        edits=(
            Edit(
                "src/mpsboost/recipes/vae/common.py",
                "        opts = replace(opts, dense_inputs=True)\n",
                "        pass\n",
            ),
        ),
        tests=("tests/recipes/vae/test_vae_strided_inputs.py", "-k", "wan21"),
    ),
    Mutation(
        name="sdpa-probe-blind",
        why="the selftest's strided-SDPA probe calls a build with the bug fixed (threshold raised past any error)",
        edits=(
            Edit(
                "src/mpsboost/selftest/probes.py",
                '"has the bug" if worst > 1e-3 else "fixed"',
                '"has the bug" if worst > 10 else "fixed"',
            ),
        ),
        tests=("tests/integration/test_selftest_strided.py",),
    ),
    Mutation(
        name="ondevice-tie-goes-to-candidate",
        why="a candidate kernel timed as fast as stock on the user's Mac is taken (ties must go to stock)",
        edits=(Edit("src/mpsboost/ondevice.py", "    taken = med < 1.0 - margin\n", "    taken = med <= 1.0\n"),),
        tests=("tests/core/test_ondevice.py",),
    ),
    Mutation(
        name="ondevice-times-a-simulated-mac",
        why="patch() under a simulated Mac environment times kernels (nothing may be timed off a real Mac)",
        edits=(
            Edit(
                "src/mpsboost/ondevice.py",
                '    if mode == "static" or env.simulated or env.device_type != "mps":\n',
                '    if mode == "static" or env.device_type != "mps":\n',
            ),
        ),
        tests=("tests/core/test_ondevice.py",),
    ),
    Mutation(
        name="ondevice-cache-ignores-torch-build",
        why="a verdict timed under one torch build is reused under another (the cache key drops the build)",
        edits=(Edit("src/mpsboost/ondevice.py", '|torch {env.torch_version.raw}"', '"'),),
        tests=("tests/core/test_ondevice.py",),
    ),
    Mutation(
        name="nested-patch-overlap-ignored",
        why="patch() no longer sees what an earlier patch() of a nested or enclosing model changed",
        edits=(
            Edit(
                "src/mpsboost/api.py",
                "            inside = _patched_inside(match.module, recipe.name, seen)\n",
                "            inside = []\n",
            ),
        ),
        tests=("tests/core/test_api.py", "-k", "inner or outer"),
    ),
    Mutation(
        name="unpatch-skips-nested-records",
        why="unpatch(outer) leaves the patches of a patch() made on a model inside it",
        edits=(
            Edit(
                "src/mpsboost/api.py",
                "        nested = _nested_records(obj, targets)\n",
                "        nested = []\n",
            ),
        ),
        tests=("tests/core/test_api.py", "-k", "inner or outer"),
    ),
    Mutation(
        name="patch-inside-timed-region-e2e",
        why="the end-to-end benchmark re-patches inside the timed generate() call",
        edits=(
            Edit(
                "benchmarks/e2e.py",
                "            torch.manual_seed(a.seed + 2)  # the sampling seed, the same for every call\n",
                "            torch.manual_seed(a.seed + 2)  # the sampling seed, the same for every call\n"
                "            if name == 'mpsboost':\n"
                "                mpsboost.unpatch(m)\n"
                "                apply_variant(m, name, a)\n",
            ),
        ),
        tests=("tests/bench/test_e2e_bench.py", "-k", "not_timed"),
        quick=True,
    ),
    Mutation(
        name="selftest-budget-between-workloads-only",
        why="the selftest checks its budget only between workloads, not before each step of one",
        edits=(
            Edit(
                "src/mpsboost/selftest/workloads.py",
                "        if deadline is not None and clock() > deadline:\n            raise BudgetSpent(what)\n",
                "        pass\n",
            ),
        ),
        tests=("tests/integration/test_selftest.py", "-k", "budget_is_checked"),
        quick=True,
    ),
    Mutation(
        name="harness-imports-matplotlib",
        why="import mpsboost.bench imports matplotlib itself",
        edits=(Edit("src/mpsboost/bench/__init__.py", "", "\nimport matplotlib  # noqa: E402,F401\n"),),
        tests=("tests/bench/test_bench_records.py", "-k", "stays_light"),
        quick=True,
    ),
    Mutation(
        name="fp8-metal-nan-codes-read-as-480",
        why="the fp8 Metal GEMV no longer seeds a row's sum with NaN where its 16 codes hold 0x7F/0xFF (+-480 x scale)",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8_metal.py",
                "          seed = mpsb_nan_seed(c.x, c.y, c.z, c.w);\n",
                "          seed = 0.0f;\n",
            ),
        ),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "nan_codes_give_nan and float16"),
    ),
    Mutation(
        name="fp8-metal-out-rows-unchecked",
        why="the fp8 Metal launch takes a 2-D out of any row count (the kernel writes past a short one)",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8_metal.py",
                "            ok = out.shape == (r, n) and (n == 1 or out.stride(1) == 1)",
                "            ok = out.shape[-1] == n and (n == 1 or out.stride(1) == 1)",
            ),
        ),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "too_few_rows"),
    ),
    Mutation(
        name="medium-copy-write-unchecked",
        why="the medium model's copies share its tensors, and a cost no longer checks that nothing wrote into them",
        edits=(
            Edit("tests/step_costs.py", "            assert self.versions() == before,", "            assert True,"),
        ),
        tests=("tests/quant/test_low_bit_decode_cost.py", "-k", "medium_copies"),
    ),
    Mutation(
        name="conversion-bench-always-identical",
        why="the conversion benchmark records mpsboost's fp8 codes as identical to the formula's without comparing",
        edits=(
            Edit(
                "benchmarks/conversion.py",
                "    same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)\n",
                "    same = True\n",
            ),
        ),
        tests=("tests/bench/test_conversion_bench.py", "-k", "independent_reference"),
    ),
    Mutation(
        name="fp8-finite-check-trusts-the-sum",
        why="the fp8 finite check refuses a weight whose sum overflows though every value is finite",
        edits=(
            Edit(
                "src/mpsboost/recipes/fp8/recipe.py",
                "    if bool(t.sum().isfinite()):\n        return True\n",
                "    return bool(t.sum().isfinite())\n",
            ),
        ),
        tests=("tests/recipes/fp8/test_fp8.py", "-k", "whatever_their_sum"),
    ),
    Mutation(
        name="fp8-quantize-zero-dim-scale-in-the-weights-dtype",
        why="a 0-dim (tensorwise) scale takes no part in type promotion: the quotient is computed in bf16",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8.py",
                "        sc = scale.reshape(1) if scale.dim() == 0 else scale[s]\n",
                "        sc = scale if scale.dim() == 0 else scale[s]\n",
            ),
        ),
        tests=("tests/recipes/fp8/test_fp8.py", "-k", "float32_quotient"),
    ),
    Mutation(
        name="fp8-scale-from-the-maximum-alone",
        why="the fp8 scale takes max(w) instead of max |w|: rows whose largest magnitude is negative overflow",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8.py",
                "        return torch.maximum(w.amax(dim=dims, keepdim=True), w.amin(dim=dims, keepdim=True).neg())\n",
                "        return w.amax(dim=dims, keepdim=True)\n",
            ),
        ),
        tests=("tests/recipes/fp8/test_fp8.py", "-k", "float32_quotient"),
        quick=True,
    ),
    Mutation(
        name="fp8-out-operators-size-unchecked",
        why="the fp8 _out operators no longer check out's element count (CPU: a view error; MPS: the launch's)",
        edits=(Edit("src/mpsboost/ops/fp8.py", "    if out.numel() != r * n:\n", "    if False:\n"),),
        tests=("tests/recipes/fp8/test_fp8_metal_path.py", "-k", "wrong_size"),
    ),
    Mutation(
        name="fp8-metal-scale-dtype-unchecked",
        why="the fp8 Metal launch takes a scale in any dtype (the kernel reads its bits as float32)",
        edits=(Edit("src/mpsboost/ops/fp8_metal.py", "    if scale.dtype is not torch.float32:\n", "    if False:\n"),),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "scale_and_offs"),
    ),
    Mutation(
        name="grouped-mm-mps-scale-not-float32",
        why="mpsboost::grouped_mm's MPS kernel passes a bf16/fp16 scale to the kernel as it is",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8_grouped.py",
                "fp8_metal.rows_gemv(x, w, scale.float().contiguous(), offs.contiguous()",
                "fp8_metal.rows_gemv(x, w, scale.contiguous(), offs.contiguous()",
            ),
        ),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "scale_and_offs"),
    ),
    Mutation(
        name="fp8-metal-self-check-no-strided-out",
        why="the fp8 Metal self-check never passes out= (a kernel ignoring out's row stride would pass it)",
        edits=(Edit("src/mpsboost/ops/fp8_metal.py", 'if okind == "strided":\n', "if False:\n"),),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "budget or out-row-stride"),
    ),
    Mutation(
        name="fp8-metal-self-check-exact-decode-fp32-only",
        why="the fp8 Metal self-check decodes every code exactly in float32 only (fp16/bf16 rounding unchecked)",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8_metal.py",
                "    for dtype, _ in _DTYPES:\n        for s, c in",
                "    for dtype, _ in _DTYPES[:1]:\n        for s, c in",
            ),
        ),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "bf16-output-truncated or fp16-weights"),
    ),
    Mutation(
        name="fp8-metal-self-check-no-128-blocks",
        why="the fp8 Metal self-check drops its 128x128-block case (published checkpoints' layout)",
        edits=(
            Edit(
                "src/mpsboost/ops/fp8_metal.py",
                '    (2, 150, 272, 0, (128, 128), None, "2d", None),',
                '    (2, 150, 272, 0, (1, None), None, "2d", None),',
            ),
        ),
        tests=("tests/ops/test_fp8_metal_emulated.py", "-k", "budget"),
    ),
    Mutation(
        name="mutations-tool-runs-stale-lists",
        why="tools/mutations.py runs the tests of a list whose entries no longer match the tree (no preflight)",
        edits=(Edit("tools/mutations.py", "    problems = stale(MUTATIONS)\n", "    problems = []\n"),),
        tests=("tests/core/test_mutations_tool.py", "-k", "stale_entry"),
        quick=True,
    ),
    Mutation(
        name="cli-help-imports-torch",
        why="mpsboost --help imports torch before it answers (25 s on a busy machine)",
        edits=(Edit("src/mpsboost/cli.py", "import argparse\n", "import argparse\n\nimport torch  # noqa: F401\n"),),
        tests=("tests/core/test_cli.py", "-k", "help_answers_before_torch"),
        quick=True,
    ),
    Mutation(
        name="cookbook-help-imports-torch",
        why="every cookbook script's --help imports torch (recipes/_common.py at module level)",
        edits=(
            Edit(
                "recipes/_common.py",
                "from mpsboost.bench.harness import best_device, machine_load\n",
                "import torch  # noqa: F401\nfrom mpsboost.bench.harness import best_device, machine_load\n",
            ),
        ),
        tests=("tests/core/test_cli.py", "-k", "help_answers_before_torch"),
        quick=True,
    ),
    Mutation(
        name="doctor-first-screen-is-the-matrix",
        why="mpsboost doctor prints the whole gate matrix (85 lines up to 536 characters) instead of what applies",
        edits=(
            Edit(
                "src/mpsboost/cli.py",
                "    lines = _doctor_all(info, env) if args.all else _doctor_screen(info, env)\n",
                "    lines = _doctor_all(info, env)\n",
            ),
        ),
        tests=("tests/core/test_cli.py", "-k", "first_screen"),
    ),
    Mutation(
        name="doctor-one-layer-loses-attention",
        why="the doctor's cut Qwen3.6 keeps one layer, a DeltaNet one: its attention layer's recipes vanish",
        edits=(
            Edit(
                "src/mpsboost/cli.py",
                '        keep = max(int(out.get("full_attention_interval") or 1), 2)\n',
                "        keep = 1\n",
            ),
        ),
        tests=("tests/core/test_cli.py", "-k", "first_screen_says_what_applies"),
    ),
    Mutation(
        name="plan-refuses-shipped-hub-ids",
        why="mpsboost plan Qwen/Qwen3.6-35B-A3B says 'not a folder' though its config ships in the package",
        edits=(
            Edit(
                "src/mpsboost/cli.py",
                "    shipped = not Path(args.path).exists() and _HUB_ID.match(args.path) is not None\n",
                "    shipped = False\n",
            ),
        ),
        tests=("tests/core/test_cli.py", "-k", "hub_id"),
    ),
    Mutation(
        name="demo-deltanet-default-gates",
        why="the demo's Qwen3.6 keeps transformers' random gates: no DeltaNet state crosses a 64-token chunk",
        edits=(Edit("src/mpsboost/demo.py", "    _slow_decay_gates(lm, seed=5)\n", ""),),
        tests=("tests/integration/test_demo.py", "-k", "models_are_the_seeds"),
    ),
    Mutation(
        name="demo-lines-not-wrapped",
        why="the demo prints its lines as built (566 characters before), not wrapped to a terminal",
        edits=(Edit("src/mpsboost/demo.py", "        if len(line) <= width:\n", "        if True:\n"),),
        tests=("tests/integration/test_demo.py", "-k", "fit_a_terminal"),
        quick=True,
    ),
    Mutation(
        name="docs-gate-releases-repeats-features",
        why="docs/support.md's list by MPS build puts a feature under every build that has it, not its first",
        edits=(Edit("src/mpsboost/docs.py", " and (i == 0 or not ok[n][i - 1])]", "]"),),
        tests=("tests/core/test_docs.py", "-k", "list_of_what"),
    ),
    Mutation(
        name="patch-mixes-environments",
        why="patch() under another environment than an earlier patch() of the model goes ahead without a word",
        edits=(Edit("src/mpsboost/api.py", "        _check_same_env(obj, targets, env)\n", ""),),
        tests=("tests/core/test_api.py", "-k", "another_environment"),
        quick=True,
    ),
    Mutation(
        name="decode-linear-calls-fp8-layers-accelerate-hooks",
        why="decode_linear no longer tells mpsboost's own forwards (fp8_weights after load_fp8) from another library's",
        edits=(
            Edit("src/mpsboost/recipes/decode_linear.py", "            if owner is not None:", "            if False:"),
        ),
        tests=("tests/recipes/fp8/test_fp8_decode_linear_reason.py", "-k", "named_as_mpsboosts"),
    ),
    Mutation(
        name="selftest-recipe-lines-ignore-workloads",
        why="a recipe without a tiny check says a bare 'no workload' though this run's workloads exercised it",
        edits=(
            Edit(
                "src/mpsboost/selftest/run.py",
                '        if res.status == "no workload" and (covered or {}).get(recipe.name):',
                "        if False:",
            ),
        ),
        tests=("tests/integration/test_selftest.py", "-k", "without_a_tiny_check"),
    ),
    Mutation(
        name="bench-cli-no-busy-warning",
        why="mpsboost bench prints no ratio ranges and no busy-machine warning",
        edits=(
            Edit(
                "src/mpsboost/bench/cli.py",
                "    for line in harness.ratio_lines(records, load_before=load_before):",
                "    for line in ():",
            ),
        ),
        tests=("tests/bench/test_bench_cli_output.py", "-k", "busy"),
        quick=True,
    ),
    Mutation(
        name="bench-plot-labels-left-crowded",
        why="the bench chart keeps x labels that overlap",
        edits=(Edit("src/mpsboost/bench/plot.py", "    if not crowded:\n        return\n", "    return\n"),),
        tests=("tests/bench/test_bench_cli_output.py", "-k", "overlap"),
    ),
    Mutation(
        name="strict-message-one-line-per-target",
        why="strict=True's error lists every skipped target again (one line per layer, not per recipe)",
        edits=(
            Edit(
                "src/mpsboost/api.py",
                "        by.setdefault(r.recipe, []).append(r)\n",
                "        by[f'{r.recipe} {r.target}'] = [r]\n",
            ),
        ),
        tests=("tests/core/test_api.py", "-k", "strict_on_the_cpu"),
    ),
    # In-place edits through .data (issue 38, item 2): a weight the decode step reads by a copy instead of a view,
    # or a per-prompt copy no longer made again, leaves patched logits off stock's after a PEFT-style merge.
    Mutation(
        name="data-edit-deltanet-ba-fused-copy",
        why="the DeltaNet decode step multiplies by one fused copy of in_proj_b/in_proj_a (a .data edit is lost)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "        weights = [w.detach() for w in weights]\n",
                "        weights = [w.detach() for w in weights]\n"
                '        if lay.family != "qkvz":\n'
                "            weights[-2:] = [torch.cat(weights[-2:])]\n",
            ),
        ),
        tests=("tests/recipes/test_data_edits.py", "-k", "mid_sequence_is_read and qwen3_5_moe"),
        quick=True,
    ),
    Mutation(
        name="data-edit-deltanet-conv-weight-copied",
        why="the DeltaNet decode step's conv weight is a copy of conv1d.weight (a .data edit is lost)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                '"conv_w": conv.weight.squeeze(1),',
                '"conv_w": conv.weight.squeeze(1).clone(),',
            ),
        ),
        tests=("tests/recipes/test_data_edits.py", "-k", "mid_sequence_is_read and qwen3_5_moe"),
    ),
    Mutation(
        name="data-edit-deltanet-norm-weight-copied",
        why="the DeltaNet decode step's output norm weight is a copy (a .data edit is lost)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                '"norm_w": getattr(mod, lay.row.norm).weight,',
                '"norm_w": getattr(mod, lay.row.norm).weight.clone(),',
            ),
        ),
        tests=("tests/recipes/test_data_edits.py", "-k", "mid_sequence_is_read and olmo_hybrid"),
    ),
    Mutation(
        name="data-edit-deltanet-gates-not-remade-at-prefill",
        why="the DeltaNet gates' copies of dt_bias and exp(A_log) are kept across prompts (a merge is lost)",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "            d.update(_gate_consts(mod, state.layout, eager=True))\n",
                "            pass\n",
            ),
        ),
        tests=("tests/recipes/test_data_edits.py", "-k", "gate_merge_between_prompts"),
    ),
    Mutation(
        name="data-edit-rms-norm-not-remade-at-prompts",
        why="rms_norm keeps its 1 + w across prompts (a merge of a norm weight is lost)",
        edits=(
            Edit(
                "src/mpsboost/recipes/rms_norm.py",
                "                and hidden_states.shape[1] > 1\n",
                "                and hidden_states.shape[1] > 1 << 30\n",
            ),
        ),
        tests=("tests/recipes/test_data_edits.py", "-k", "between_prompts and qwen3_5_moe"),
    ),
    Mutation(
        name="deltanet-state-view-of-another-cache",
        why="the DeltaNet step reuses its view of a recurrent state for another cache's state tensor",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                "        if c is not None and c[0]() is rec and c[1] == rec.data_ptr() and c[2] == rec.shape:\n",
                "        if c is not None and c[2] == rec.shape:\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "two_sequences"),
        quick=True,
    ),
    # The chunked DeltaNet scan's carry across 64-token chunks (issue 38, item 3): red only with slow-decay gates.
    Mutation(
        name="deltanet-scan-chunk-decay-off-by-one",
        why="each chunk's state decays by the cumulative gate of its second-to-last token",
        edits=(
            Edit(
                "src/mpsboost/ops/gated_delta.py",
                "        cum[..., -1].exp().reshape(bh, n_chunks)",
                "        cum[..., -2].exp().reshape(bh, n_chunks)",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "many_chunks or matches_transformers_reference"),
        quick=True,
    ),
    Mutation(
        name="deltanet-scan-state-not-decayed",
        why="the state carried to the next chunk is not decayed by the chunk's gates",
        edits=(
            Edit(
                "src/mpsboost/ops/gated_delta.py",
                "        state.mul_(decay).baddbmm_(kt, v_new)\n",
                "        state.baddbmm_(kt, v_new)\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "layer_outputs_match_stock_fp32 and qwen3_5_moe-2-mps"),
    ),
    Mutation(
        name="deltanet-scan-query-decay-from-chunk-start",
        why="a chunk's queries read the carried state decayed by the chunk's first gate only",
        edits=(
            Edit(
                "src/mpsboost/ops/gated_delta.py",
                "    query = query * cum.exp().unsqueeze(-1)\n",
                "    query = query * cum[..., :1].exp().unsqueeze(-1)\n",
            ),
        ),
        tests=("tests/recipes/test_linear_attention.py", "-k", "many_chunks or matches_transformers_reference"),
        quick=True,
    ),
    Mutation(
        name="decode-linear-counted-as-the-cpu-composite",
        why="a Mac's one aten::linear kernel is counted as the CPU's t + mm/addmm (one op too many per linear)",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "    return [(torch.ops.aten.linear.default, (x, w, b), None)]\n",
                "    return None\n",
            ),
        ),
        tests=("tests/bench/test_decode_step_target.py", "-k", "linear_is_one_op"),
        quick=True,
    ),
    Mutation(
        name="decode-records-inside-a-recorded-op",
        why="what runs inside a registered operator's reference kernel is recorded again beside the operator",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "        self.quiet += 1  # what runs inside this op",
                "        self.quiet += 0  # what runs inside this op",
            ),
        ),
        tests=("tests/bench/test_decode_step_target.py", "-k", "inside_a_recorded_op"),
        quick=True,
    ),
    Mutation(
        name="decode-bytes-of-ops-that-launch-nothing",
        why="the decode cost counts bytes for ops that launch nothing (an _unsafe_view's output)",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "        if launches(func, args, kwargs, out):  # an op that launches nothing",
                "        if True:  # an op that launches nothing",
            ),
        ),
        tests=("tests/bench/test_decode_step_target.py", "-k", "only_ops_that_launch"),
    ),
    Mutation(
        name="low-bit-loaded-linear-shape-dropped",
        why="from_pretrained asks the low-bit recipe without a linear's shape: no loaded layer gets the Mac's choice",
        edits=(
            Edit(
                "src/mpsboost/quant/load.py",
                "compute, env, where, shape=shape)",
                "compute, env, where, shape=None)",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "from_pretrained_hands"),
        quick=True,
    ),
    Mutation(
        name="int4pack-float64-on-the-device",
        why="the int4pack conversion's exactness check runs in float64 on the codes' device (MPS has no float64)",
        edits=(
            Edit(
                "src/mpsboost/ops/affine.py",
                '    s = scales.to("cpu", torch.float64)\n    zero',
                "    s = scales.to(torch.float64)\n    zero",
            ),
        ),
        tests=("tests/ops/test_affine_ops.py", "-k", "off_the_device"),
        quick=True,
    ),
    Mutation(
        name="fp8-experts-choice-verdict-ignored",
        why="a timed fp8 experts choice that is not faster keeps mpsboost's grouped GEMV anyway",
        edits=(
            Edit(
                "src/mpsboost/recipes/fp8/recipe.py",
                '    return ("grouped" if choice.taken else "scaled_mm"), choice.describe()\n',
                '    return "grouped", choice.describe()\n',
            ),
        ),
        tests=("tests/recipes/fp8/test_fp8_experts_metal_choice.py", "-k", "tie_or_slower or timing_error"),
        quick=True,
    ),
    Mutation(
        name="fp8-experts-choice-never-asked",
        why="an fp8 experts module a Mac could time keeps the grouped GEMV untimed (the choice is never asked)",
        edits=(
            Edit(
                "src/mpsboost/recipes/fp8/recipe.py",
                '            if torch_few_rows and opts.mps_kernel == "auto":\n',
                "            if False:\n",
            ),
        ),
        tests=("tests/recipes/fp8/test_fp8_experts_metal_choice.py", "-k", "faster_and_caches or experts_run"),
        quick=True,
    ),
    Mutation(
        name="decode-predict-drops-mpsgraph-term",
        why="the Mac cost model leaves out the MPSGraph dispatches' time",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                " + metal * c_metal_us * 1e-6 + graph * c_graph_us * 1e-6\n",
                " + metal * c_metal_us * 1e-6\n",
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "predict_adds"),
        quick=True,
    ),
    Mutation(
        name="decode-predict-drops-bytes-term",
        why="the Mac cost model leaves out the bytes' time",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                '    seconds = step["bytes"] / (eta * bandwidth_gbs * 1e9) + metal',
                '    seconds = 0 * step["bytes"] / (eta * bandwidth_gbs * 1e9) + metal',
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "predict_adds"),
        quick=True,
    ),
    Mutation(
        name="decode-predict-mixed-never-mpsgraph",
        why="ops that ship both paths are priced as Metal even when asked to price them as MPSGraph",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                '    graph = step["mpsgraph"] + (other if mixed == "mpsgraph" else 0)\n',
                '    graph = step["mpsgraph"]\n',
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "mixed_both_ways"),
        quick=True,
    ),
    Mutation(
        name="decode-scale-ignores-blocks-per-model",
        why="a small model's block counts are multiplied by the real number of blocks without dividing by its own",
        edits=(Edit("src/mpsboost/bench/decode_cost.py", "add(block, n / blocks[block])", "add(block, n)"),),
        tests=("tests/bench/test_decode_predict.py", "-k", "scale_multiplies"),
        quick=True,
    ),
    Mutation(
        name="decode-dispatch-counts-views",
        why="a view (alias annotation on the return) counts as a kernel launch",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "    if func.is_view or torch.Tag.inplace_view in func.tags:\n",
                "    if torch.Tag.inplace_view in func.tags:\n",
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "not_dispatches"),
        quick=True,
    ),
    Mutation(
        name="decode-dispatch-counts-relabels",
        why="an op that returns a relabel of its input's storage without an alias annotation (_unsafe_view) counts",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "        if outs and all(",
                "        if False and all(",
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "not_dispatches"),
        quick=True,
    ),
    Mutation(
        name="decode-dispatch-kind-ignores-the-wheel-table",
        why="every aten dispatch is taken for a Metal shader, whatever the release's wheel ships",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                '    return row or "unlisted"\n',
                '    return "metal"\n',
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "kinds_per_release"),
        quick=True,
    ),
    Mutation(
        name="selftest-cost-bounds-unchecked",
        why="the validator accepts any dispatch cost and bandwidth share a probe line carries",
        edits=(
            Edit(
                "src/mpsboost/selftest/report.py",
                '        _check_costs(where, name, rec.get("measured") or {}, bounds=measured_here)\n',
                "",
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "refuses_constants"),
        quick=True,
    ),
    Mutation(
        name="selftest-cost-bounds-eta-zero-allowed",
        why="an eta of 0 (no bandwidth at all) passes the validator",
        edits=(
            Edit(
                "src/mpsboost/selftest/report.py",
                '"eta": (0.0, 1.0, False)',
                '"eta": (0.0, 1.0, True)',
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "refuses_constants"),
        quick=True,
    ),
    Mutation(
        name="metal-emulation-threads-always-in-ascending-order",
        why="the Metal emulation runs every threadgroup's threads in one order: a stale read from below goes unseen",
        edits=(
            Edit("tests/ops/metal_emu/driver.cpp", "    fibers.run(ctx, g % 2 == 1);", "    fibers.run(ctx, false);"),
        ),
        tests=("tests/ops/test_metal_emulation.py",),
        quick=True,
    ),
    Mutation(
        name="metal-emulation-deadlock-unreported",
        why="the Metal emulation's scheduler goes on resuming threads that wait at a barrier no other thread reaches",
        edits=(
            Edit("tests/ops/metal_emu/driver.cpp", "      if (left && left == left_before &&", "      if (false &&"),
        ),
        tests=("tests/ops/test_metal_emulation.py", "-k", "deadlock"),
    ),
    Mutation(
        name="deltanet-metal-no-barrier-after-the-projections",
        why="the fused DeltaNet kernel sums |q|^2 and |k|^2 before every thread has written q and k (a race at dk 64)",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                "  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  // 2. |q|^2",
                "\n\n  // 2. |q|^2",
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "continued_steps and dk64"),
    ),
    Mutation(
        name="deltanet-metal-decay-skipped-in-update",
        why="the fused DeltaNet kernel updates the state without decaying it (S + k d^T for decay S + k d^T)",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                "const float s = col[i * dv] * decay + (tk[i] * ks) * d;",
                "const float s = col[i * dv] + (tk[i] * ks) * d;",
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "continued_steps and b1-r1"),
    ),
    Mutation(
        name="deltanet-metal-v-channels-of-key-head-0",
        why="every threadgroup of the fused DeltaNet kernel reads and rolls the v channels of key head 0",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                ": 2 * kd + g * cols + (i - 2 * dk));",
                ": 2 * kd + (i - 2 * dk));",
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "continued_steps and b2-r2-bf16"),
    ),
    Mutation(
        name="deltanet-metal-beta-scale-dropped",
        why="the fused DeltaNet kernel ignores OLMo-Hybrid's beta scale 2 (negative eigenvalues)",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                "const float beta = bscale * mpsb_dn_sigmoid(",
                "const float beta = mpsb_dn_sigmoid(",
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "beta2"),
    ),
    Mutation(
        name="deltanet-metal-head-norm-of-head-0",
        why="the fused DeltaNet kernel's gated norm divides every value head by the first head's RMS",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                "const float inv = 1.0f / sqrt(tn[2 + hl] / float(dv) + eps);",
                "const float inv = 1.0f / sqrt(tn[2] / float(dv) + eps);",
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "continued_steps and b4-r4"),
    ),
    Mutation(
        name="deltanet-self-check-ignores-the-state",
        why="deltanet_metal.self_check compares the output alone: a kernel that gets the state wrong passes",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_metal.py",
                '            for name, want, have in zip(("output", "conv state", "state"), (args[8], args[1], args[2]), got):',  # noqa: E501
                '            for name, want, have in zip(("output",), (args[8],), got):',
            ),
        ),
        tests=("tests/ops/test_deltanet_metal_emulated.py", "-k", "self_check"),
    ),
    Mutation(
        name="deltanet-op-conv-state-mutation-undeclared",
        why="mpsboost::deltanet_step writes the conv state without declaring it mutated (torch.compile would "
        "drop the write)",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_step.py",
                'mutates_args=("conv_state", "state", "out")',
                'mutates_args=("state", "out")',
            ),
        ),
        tests=("tests/ops/test_deltanet_step.py", "-k", "opcheck"),
        quick=True,
    ),
    Mutation(
        name="deltanet-reference-dt-bias-dropped",
        why="the composed DeltaNet step (the operator's CPU/CUDA implementation) computes the decay without dt_bias",
        edits=(
            Edit(
                "src/mpsboost/ops/deltanet_ref.py",
                "y[:, off + hv : off + 2 * hv].to(f32) + dt_bias.to(f32)",
                "y[:, off + hv : off + 2 * hv].to(f32)",
            ),
        ),
        tests=("tests/ops/test_deltanet_step.py", "-k", "continued_steps and b1-r1"),
        quick=True,
    ),
    Mutation(
        name="deltanet-fused-static-choice-composed",
        why="linear_attention's static choice (simulated Mac, option static) is the composed step, against the cost "
        "model",
        edits=(Edit("src/mpsboost/recipes/linear_attention.py", "        static=True,\n", "        static=False,\n"),),
        tests=("tests/recipes/test_linear_attention_fused.py", "-k", "simulated_mac and 2.15"),
        quick=True,
    ),
    Mutation(
        name="deltanet-fused-timing-ignored",
        why="linear_attention takes the fused step on a real Mac whatever the timing said",
        edits=(
            Edit(
                "src/mpsboost/recipes/linear_attention.py",
                '    return choice.taken, f"decode step: {choice.describe()}; {_STATIC_WHY}"',
                '    return True, f"decode step: {choice.describe()}; {_STATIC_WHY}"',
            ),
        ),
        tests=("tests/recipes/test_linear_attention_fused.py", "-k", "tie_or_slower"),
        quick=True,
    ),
    Mutation(
        name="deltanet-low-bit-projection-copied",
        why="linear_attention's low-bit projections write their products by a product and a copy (3 ops, not 1)",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "if out is not None and x.is_contiguous() and out_fits(out, x, self.q.shape[0]):",
                "if False:",
            ),
        ),
        tests=("tests/recipes/test_linear_attention_fused.py", "-k", "low_bit"),
    ),
    Mutation(
        name="lowbit-bench-reference-code-order",
        why="the low-bit benchmark's independent reference unpacks the codes of a word highest bits first",
        edits=(
            Edit(
                "benchmarks/lowbit_load.py",
                "shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits",
                "shifts = torch.arange(per - 1, -1, -1, device=q.device, dtype=torch.int64) * bits",
            ),
        ),
        tests=("tests/bench/test_lowbit_load_bench.py", "-k", "unpack"),
        quick=True,
    ),
    Mutation(
        name="lowbit-bench-router-gates-at-default-bits",
        why="the low-bit benchmark's writer stores mlp.gate / shared_expert_gate at the default bits, not mlx-lm's 8",
        edits=(Edit("benchmarks/lowbit_load.py", "put(fm, v, *ROUTER_PARAMS)", "put(fm, v, bits, group)"),),
        tests=("tests/bench/test_lowbit_load_bench.py", "-k", "write_and_load"),
    ),
    Mutation(
        name="moe-route-kernel-ties-higher-id",
        why="the Metal route kernel breaks tied logits by the higher expert id (a stable sort's is the lower)",
        edits=(Edit("src/mpsboost/ops/moe_metal.py", "(bi < 0 || v[i] > bv)", "(bi < 0 || v[i] >= bv)"),),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "ties"),
    ),
    Mutation(
        name="moe-route-kernel-renorm-dropped",
        why="the Metal route kernel's renormalised weights use the over-all-experts formula (not the k's softmax)",
        edits=(
            Edit(
                "src/mpsboost/ops/moe_metal.py",
                "        w = exp(mv[j] - mv[0]) / s;\n",
                "        w = exp(mv[j] - top) / den;\n",
            ),
        ),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "transformers_router and qwen3_5"),
    ),
    Mutation(
        name="moe-route-kernel-positions-unstable",
        why="the Metal route kernel orders the pairs of one expert backwards (positions no longer a stable sort's)",
        edits=(Edit("src/mpsboost/ops/moe_metal.py", "(pe[q] == e && q < p)", "(pe[q] == e && q > p)"),),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "batch_1_to_4"),
    ),
    Mutation(
        name="moe-combine-kernel-shared-gate-dropped",
        why="the Metal combine adds the shared expert's output without its sigmoid gate",
        edits=(
            Edit(
                "src/mpsboost/ops/moe_metal.py",
                "      acc += mpsb_rnd(pair, s * mpsb_ld(sh[t * ss + h]));\n",
                "      acc += mpsb_ld(sh[t * ss + h]);\n",
            ),
        ),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "combine"),
    ),
    Mutation(
        name="moe-glu-kernel-silu-unrounded",
        why="the Metal gated activation's silu is off by 1e-4 relative and not rounded to the dtype first",
        edits=(
            Edit(
                "src/mpsboost/ops/moe_metal.py",
                "    const float s = mpsb_rnd(a, g / (1.0f + exp(-g)));\n",
                "    const float s = g / (1.0f + exp(-g)) * 1.0001f;\n",
            ),
        ),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "glu"),
    ),
    Mutation(
        name="moe-route-cpu-reference-not-torch-topk",
        why="the moe_route operator's CPU reference breaks ties by a stable sort, not as torch.topk (stock) does",
        edits=(
            Edit(
                "src/mpsboost/ops/moe_ref.py",
                "    vals, ids = torch.topk(probs, top_k, dim=-1)\n",
                "    vals, ids = stable_topk(probs, top_k)\n",
            ),
        ),
        tests=("tests/ops/test_moe_metal_emulated.py", "-k", "ties"),
    ),
    Mutation(
        name="moe-block-fused-never-taken",
        why="moe_block decides the fused path but never takes it (24 ops a Qwen3.5 block again)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "            fuse, fusion = choice.taken, choice.describe()\n",
                "            fuse, fusion = False, choice.describe()\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "at_most_12 and float32"),
    ),
    Mutation(
        name="moe-block-fused-static-choice-composed",
        why="moe_block's static choice (the cost model's, taken wherever nothing is timed) is the composed path",
        edits=(Edit("src/mpsboost/recipes/moe_block.py", "            static=True,\n", "            static=False,\n"),),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "report_names or simulated_mac_never"),
    ),
    Mutation(
        name="moe-block-fused-self-check-skipped",
        why="moe_block times the fused kernels on a Mac without their self-check",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "            check=check_fn if check_fn is not None else _metal_check,\n",
                "            check=None,\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "failed_self_check"),
    ),
    Mutation(
        name="moe-block-fp8-stacks-unused",
        why="moe_block's fused path leaves fp8 experts to their module (no mpsboost::grouped_mm stacks)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                '        elif fst.few_rows == "grouped":\n',
                "        elif False:\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "at_most_12 and fp8"),
    ),
    Mutation(
        name="moe-block-low-bit-stacks-unused",
        why="moe_block's fused path leaves low-bit experts to their module (no affine_grouped_gemv stacks)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "    if ast is not None and _affine_experts(ex, gu) and ast.kernel and ast.compute_dtype == dt:\n",
                "    if False:\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "at_most_12 and low"),
    ),
    Mutation(
        name="moe-fused-combine-positions-ignored",
        why="the fused block combines the routed outputs in expert order as if it were token order (pos dropped)",
        edits=(
            Edit(
                "src/mpsboost/ops/moe_route.py",
                "        return moe_combine(pair, weights, pos, shared, g, shape)\n",
                "        return moe_combine(pair, weights, None, shared, g, shape)\n",
            ),
        ),
        tests=("tests/recipes/moe/test_moe_block_fused.py", "-k", "more_tokens and qwen3_5"),
    ),
    Mutation(
        name="sdpa-dense-ignored",
        why="ops.attention.sdpa hands SDPA strided q/k/v even when asked for dense ones (MPS: pytorch#163597)",
        edits=(
            Edit(
                "src/mpsboost/ops/attention.py",
                "    if dense:\n        q, k, v = (t if t.is_contiguous()",
                "    if False:\n        q, k, v = (t if t.is_contiguous()",
            ),
        ),
        tests=("tests/recipes/attention/test_sdpa_dense.py", "-k", "under_mps"),
        quick=True,
    ),
    Mutation(
        name="attention-split-slices-strided",
        why="attention_split's dense calls pass the strided query slice itself (MPS reads such views wrong)",
        edits=(Edit("src/mpsboost/ops/attention_split.py", "q.contiguous() if dense else q, key", "q, key"),),
        tests=("tests/recipes/attention/test_sdpa_dense.py", "-k", "slices_when_dense"),
        quick=True,
    ),
    Mutation(
        name="rms-norm-float32-weight-after",
        why="a float32 round_then_scale norm applies its weight after the call (one aten op more than the module)",
        edits=(
            Edit(
                "src/mpsboost/ops/norm.py",
                'form == "round_then_scale" and x.dtype == torch.float32 and',
                "False and x.dtype == torch.float32 and",
            ),
        ),
        tests=("tests/recipes/test_rms_norm.py", "-k", "no_more_aten_ops"),
        quick=True,
    ),
    Mutation(
        name="moe-experts-stored-step-aside-dropped",
        why="moe_experts binds its bf16 forward over experts a low-bit or fp8 layer stores (the codes multiplied "
        "as weights: a later patch() of a from_pretrained / load_fp8 model breaks its forward)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_experts.py",
                "        if stored is not None:\n            return Decision.skip(stored,",
                "        if False:\n            return Decision.skip(stored,",
            ),
        ),
        tests=("tests/quant/test_low_bit_repatch.py", "-k", "qwen3_moe and cpu and default or fp8"),
        quick=True,
    ),
    Mutation(
        name="moe-experts-low-bit-reason-lost",
        why="moe_experts no longer recognises mpsboost's low-bit experts (the dtype rule still skips them, "
        "but the row no longer names the low-bit layer)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_experts.py",
                "    st = affine_state(module)\n    if st is not None:\n",
                "    st = affine_state(module)\n    if False:\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_repatch.py", "-k", "qwen3_5_moe and mps and named"),
    ),
    Mutation(
        name="attention-decode-fused-gated-mode-wrong",
        why="attention_decode's fused step norms the gated family's q/k as qk_norm does (weight, not 1 + weight)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                "eps=lay.eps, mode=MODES[lay.family]\n",
                'eps=lay.eps, mode=MODES["qk_norm" if lay.family == "gated" else lay.family]\n',
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "bf16 and qwen3_5_moe"),
        quick=True,
    ),
    Mutation(
        name="attention-decode-fused-qk-weights-not-refreshed",
        why="attention_decode's fused q/k norm weights (1 + w, or w in float32) are not made again at a prompt: a "
        ".data edit of q_norm/k_norm is lost on the fused path",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                '            d["qk_w"] = _qk_weights(mod, state.layout, True)\n',
                "            pass\n",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "data_edit and auto"),
        quick=True,
    ),
    Mutation(
        name="attention-decode-composed-norm-not-remade",
        why="the composed path's (fused='off') per-row q/k norm weights are not made again at a prompt (the "
        "data-edit-attention-norm-not-remade-at-prefill entry's edit; its test now runs the fused path)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                '            d["norm_w"] = _norm_weight(mod, state.layout, True)\n',
                "            pass\n",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "data_edit and off"),
    ),
    Mutation(
        name="attention-decode-composed-dense-dropped",
        why="the composed path's (fused='off') MPS decision to copy its strided query before SDPA is not passed on "
        "(the attention-decode-dense-dropped entry's edit; its test now runs the fused path, whose q is dense)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                "mask, scale=mod.scaling, dense=st.dense)",
                "mask, scale=mod.scaling, dense=False)",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "dense_query"),
    ),
    Mutation(
        name="attention-decode-fused-never-taken",
        why="attention_decode's choice never takes mpsboost::attn_qk_rope_cache (the static choice ignored)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                'return choice.taken, f"q/k norm and rotary:',
                'return False, f"q/k norm and rotary:',
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "at_most_16 and qwen3_5_moe"),
        quick=True,
    ),
    Mutation(
        name="attention-decode-fused-option-off-ignored",
        why="attention_decode's option fused='off' keeps the fused operator",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                '    if mode == "off":\n        return False, "q/k norm',
                '    if False:\n        return False, "q/k norm',
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "off_the_mac"),
    ),
    Mutation(
        name="attention-decode-fused-lost-in-a-copy",
        why="a deep copy of a patched model runs the composed step (the fused decision not copied)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                "self.cache_arg, self.dense, self.fused)",
                "self.cache_arg, self.dense)",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "copy_keeps"),
    ),
    Mutation(
        name="attention-decode-fused-check-skipped",
        why="attention_decode's real-Mac choice times the fused operator without comparing it with the composed chain",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                "        check=_pair_check(pair, dtype),\n",
                "        check=None,\n",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "outputs_differ"),
    ),
    Mutation(
        name="attention-decode-fused-timed-at-full-rotary",
        why="attention_decode times the fused operator at the full head width where the layer's rotary is partial",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                "    rd = _configured_rotary_dim(mod, lay) or lay.d\n",
                "    rd = lay.d\n",
            ),
        ),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "layer_shape"),
    ),
    Mutation(
        name="attention-decode-fused-norm-dtype-ignored",
        why="attention_decode takes the fused operator for Qwen3 norms whose weights are in another dtype than the "
        "activations (the operator would round the weight to the activations' dtype)",
        edits=(Edit("src/mpsboost/recipes/attention_decode.py", "        if wd != {dtype}:\n", "        if False:\n"),),
        tests=("tests/recipes/attention/test_attention_decode_fused.py", "-k", "cannot_take"),
    ),
    Mutation(
        name="attention-decode-low-bit-shape-refused",
        why="attention_decode reads a stored projection's size from its codes (packed low-bit: steps aside)",
        edits=(
            Edit(
                "src/mpsboost/recipes/attention_decode.py",
                '        dense = (getattr(m, "out_features", None), getattr(m, "in_features", None))\n',
                "        dense = tuple(w.shape)\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_decode_cost.py", "-k", "equals_the_low_bit_model and 4"),
        quick=True,
    ),
    Mutation(
        name="decode-cost-affine-grouped-reads-every-expert",
        why="the decode cost counts every expert's codes for a low-bit grouped GEMV, not the hit experts' only",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                '    elif name == "affine_grouped_gemv" and len(ins) == 5',
                "    elif False and len(ins) == 5",
            ),
        ),
        tests=("tests/quant/test_low_bit_decode_cost.py", "-k", "tiny and 2.15"),
    ),
    Mutation(
        name="decode-cost-rms-norm-counted-as-the-cpu-composite",
        why="the decode cost counts F.rms_norm as the CPU's six ops where a Mac dispatches one _fused_rms_norm",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "MPS_ROUTES = {F.rms_norm: _rms_norm_route, torch.rms_norm: _rms_norm_route, F.linear: _linear_route}",
                "MPS_ROUTES = {F.linear: _linear_route}",
            ),
        ),
        tests=("tests/bench/test_decode_step_target.py", "-k", "same_dtype_weight or bf16"),
        quick=True,
    ),
    Mutation(
        name="decode-cost-rms-norm-route-ignores-the-weight-dtype",
        why="an F.rms_norm whose weight is of another dtype (the composite on MPS) counted as the fused kernel",
        edits=(
            Edit(
                "src/mpsboost/bench/decode_cost.py",
                "isinstance(w, torch.Tensor) or w.dtype != x.dtype:",
                "isinstance(w, torch.Tensor):",
            ),
        ),
        tests=("tests/bench/test_decode_step_target.py", "-k", "composite_counts_the_composite"),
        quick=True,
    ),
    Mutation(
        name="affine-operand-out-is-a-product-then-a-copy",
        why="a low-bit operand's out= goes through a product and a copy (two dispatches) instead of affine_gemv_out",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "if out is not None and x.is_contiguous() and out_fits(out, x, self.q.shape[0]):",
                "if False:",
            ),
        ),
        tests=("tests/quant/test_low_bit_operand.py", "-k", "column_range"),
        quick=True,
    ),
    # Typed family rows and Literal options (issue 39, item 2): the registry refuses a value outside an option's
    # Literal and a default outside it; the decode recipes' rows check their fields when they are made.
    Mutation(
        name="options-literal-value-unchecked",
        why="make_options lets a value outside an option's Literal through to the generic type error (no values named)",
        edits=(
            Edit(
                "src/mpsboost/registry.py",
                "        if parts is not None and not _fits(value, types_[key]):\n",
                "        if False:\n",
            ),
        ),
        tests=("tests/core/test_family_rows.py", "-k", "outside_the_literal_is_refused"),
        quick=True,
    ),
    Mutation(
        name="options-literal-defaults-unchecked",
        why="register() no longer checks a recipe's Options defaults against their Literals",
        edits=(
            Edit(
                "src/mpsboost/registry.py", "        check_option_defaults(cls.name, cls.Options)\n", "        pass\n"
            ),
        ),
        tests=("tests/core/test_family_rows.py", "-k", "default_outside_its_literal"),
    ),
    Mutation(
        name="family-row-field-types-unchecked",
        why="a family row's fields are no longer checked against their annotations (norm='always' accepted)",
        edits=(
            Edit("src/mpsboost/recipes/_rows.py", "        if not value_fits(value, tp):\n", "        if False:\n"),
        ),
        tests=("tests/core/test_family_rows.py", "-k", "malformed_row"),
    ),
    Mutation(
        name="family-row-class-paths-unchecked",
        why="a family row's class-path fields take any string (a bare class name never matches an MRO)",
        edits=(
            Edit("src/mpsboost/recipes/_rows.py", '        if f.metadata.get("class_path"):\n', "        if False:\n"),
        ),
        tests=("tests/core/test_family_rows.py", "-k", "malformed_row"),
    ),
    Mutation(
        name="moe-family-row-unchecked",
        why="MoeFamily rows are not checked when made (a malformed moe_block row imports silently)",
        edits=(
            Edit(
                "src/mpsboost/recipes/moe_block.py",
                "    def __post_init__(self) -> None:\n        check_row(self)\n",
                "    def __post_init__(self) -> None:\n        pass\n",
            ),
        ),
        tests=("tests/core/test_family_rows.py", "-k", "malformed_row"),
    ),
    Mutation(
        name="fp8-metal-gemv-taken-whatever-the-timing",
        why="a real Mac keeps mpsboost's Metal fp8 GEMV even where torch's few-rows kernels timed faster",
        edits=(Edit("src/mpsboost/recipes/fp8/recipe.py", "    if choice.taken:\n", "    if True:\n"),),
        tests=("tests/recipes/fp8/test_fp8_metal_choice.py", "-k", "tie_or_slower"),
        quick=True,
    ),
    Mutation(
        name="decode-cost-calibration-ignores-the-macs-constants",
        why="a Mac's selftest file calibrates the prediction with the model's own c_metal, not the one it measured",
        edits=(
            Edit(
                "src/mpsboost/selftest/report.py",
                '"c_metal_us": float(m["c_metal_us"]),',
                '"c_metal_us": 2.05,',
            ),
        ),
        tests=("tests/bench/test_decode_predict.py", "-k", "calibrates_the_prediction"),
        quick=True,
    ),
    Mutation(
        name="fp8-row-transformers-scale-key",
        why="the transformers-fp8 row names a weight's scale <key>_scale, not <key>_scale_inv as the format does",
        edits=(Edit("src/mpsboost/quant/fp8_formats.py", 'scale_suffix="_scale_inv",', 'scale_suffix="_scale",'),),
        tests=("tests/quant/test_fp8_rows.py", "-k", "detects_plans and transformers"),
        quick=True,
    ),
    Mutation(
        name="fp8-row-scaled-fp8-scale-leaf",
        why="the scaled_fp8 row looks for <module>.weight_scale_weight instead of the format's <module>.scale_weight",
        edits=(Edit("src/mpsboost/quant/fp8_formats.py", '    scale_leaf="scale_weight",\n', ""),),
        tests=("tests/quant/test_fp8_rows.py", "-k", "detects_plans and scaled"),
    ),
    Mutation(
        name="fp8-rows-detection-order",
        why="detection asks compressed-tensors before mpsboost: save_fp8's files (their *.weight_scale) read as it",
        edits=(
            Edit(
                "src/mpsboost/quant/fp8_formats.py",
                "(MPSBOOST, TRANSFORMERS_FP8, COMPRESSED_TENSORS, SCALED_FP8)\n",
                "(COMPRESSED_TENSORS, MPSBOOST, TRANSFORMERS_FP8, SCALED_FP8)\n",
            ),
        ),
        tests=("tests/quant/test_fp8_rows.py", "-k", "detects_plans and mpsboost"),
    ),
    Mutation(
        name="fp8-ue8m0-exponent-bias",
        why="UE8M0 block scales decode with exponent bias 128, not 127: every scale half its value",
        edits=(Edit("src/mpsboost/quant/fp8_formats.py", "(raw - 127).float()", "(raw - 128).float()"),),
        tests=("tests/quant/test_fp8_rows.py", "-k", "ue8m0"),
    ),
    Mutation(
        name="low-bit-choice-static-is-torch",
        why="the low-bit Metal-or-int4pack choice's static choice is torch's pack: a simulated Mac leaves Metal",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/recipe.py",
                "        static=True,\n",
                "        static=False,\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "simulated_mac_takes_the_metal"),
        quick=True,
    ),
    Mutation(
        name="low-bit-choice-verdict-ignored",
        why="a timed low-bit choice that is not faster keeps the Metal GEMV anyway (ties and slower go to torch's)",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/recipe.py",
                "    return pack_path(pack, choice.describe())\n",
                "    return dataclasses.replace(static, note=choice.describe())\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "tie_or_slower or timing_error"),
        quick=True,
    ),
    Mutation(
        name="metal-self-check-ignored",
        why="a Metal kernel's failed patch-time self-check is ignored: it runs on a Mac that failed it (low-bit, fp8)",
        edits=(Edit("src/mpsboost/recipes/_metal.py", "    if why is not None:\n", "    if False:\n"),),
        tests=(
            "tests/quant/test_low_bit_choice.py",
            "tests/recipes/fp8/test_fp8_metal_path.py",
            "-k",
            "failed_self_check or self_check_fails",
        ),
        quick=True,
    ),
    Mutation(
        name="low-bit-int8-unrepresentable-ignored",
        why="an 8-bit layer whose groups int8pack cannot hold is planned on torch's int8pack anyway",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/paths.py",
                "    if pack is not None and unrepresentable is not None:\n",
                "    if False:\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "int8pack_only_where"),
        quick=True,
    ),
    Mutation(
        name="low-bit-int4pack-forward-unused",
        why="a layer planned on torch's int4pack never calls it (its few rows are dequantised instead)",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "        if state.pack and 0 < _rows(input) <= state.max_rows",
                "        if state.pack and 0 < _rows(input) <= 0",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "int4pack_path_computes"),
    ),
    Mutation(
        name="low-bit-pack-buffers-persistent",
        why="torch's packed copy of a low-bit linear goes into its state_dict (and so into a saved folder)",
        edits=(
            Edit(
                "src/mpsboost/patching.py",
                "    hidden_set.update(hidden)\n",
                "",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "int4pack_path_computes"),
    ),
    Mutation(
        name="low-bit-inexact-repack-kept",
        why="a 4-bit repack whose zeros round in the compute dtype is kept (int4pack on numbers not the file's)",
        edits=(
            Edit(
                "src/mpsboost/recipes/low_bit/layers.py",
                "    if why is None:\n        return state, pack\n",
                "    return state, pack\n",
            ),
        ),
        tests=("tests/quant/test_low_bit_choice.py", "-k", "inexact_4_bit"),
    ),
)


def _tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if line and (ROOT / line).is_file()]


def _copy_tree(dest: Path) -> None:
    for rel in _tree_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def _mutated(root: Path, m: Mutation) -> tuple[dict[str, str], str | None]:
    """The texts of the files ``m`` edits once its edits are applied to the tree at ``root`` (in memory),
    and the reason it cannot be applied (stale), or None."""
    texts: dict[str, str] = {}
    for e in m.edits:
        f = root / e.path
        if e.path not in texts:
            if not f.is_file():
                return texts, f"{e.path} does not exist"
            texts[e.path] = f.read_text(encoding="utf-8")
        text = texts[e.path]
        if e.old == "":  # append
            text = text + e.new
        else:
            n = text.count(e.old)
            if n != 1:
                return texts, f"{e.path}: the text to replace occurs {n} times (expected once): {e.old.strip()[:80]!r}"
            text = text.replace(e.old, e.new)
        if text == texts[e.path]:
            return texts, f"{e.path}: the edit changes nothing"
        texts[e.path] = text
    return texts, None


def stale(mutations: tuple[Mutation, ...] = MUTATIONS, root: Path = ROOT) -> list[str]:
    """Every problem of the list against the tree at ``root``, one line each: an entry that no longer
    matches its file, a repeated name, a test file that does not exist. Empty when all is well."""
    out, names = [], set()
    for m in mutations:
        if m.name in names:
            out.append(f"{m.name}: a second entry of this name")
        names.add(m.name)
        _, why = _mutated(root, m)
        if why:
            out.append(f"{m.name}: {why}")
        for t in m.tests:
            if t.startswith("tests/") and not (root / t.split("::")[0]).exists():
                out.append(f"{m.name}: its test {t} does not exist")
    return out


def _apply(dest: Path, m: Mutation) -> str | None:
    """Apply ``m`` in ``dest``; the reason it cannot be applied (stale), or None."""
    texts, why = _mutated(dest, m)
    if why:
        return why
    for path, text in texts.items():
        (dest / path).write_text(text, encoding="utf-8")
    return None


def run(m: Mutation, *, verbose: bool) -> tuple[str, str]:
    """('caught' | 'SURVIVED' | 'STALE' | 'ERROR', detail)."""
    with tempfile.TemporaryDirectory(prefix="mpsboost-mutant-") as tmp:
        dest = Path(tmp)
        _copy_tree(dest)
        stale = _apply(dest, m)
        if stale:
            return "STALE", stale
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join([str(dest / "src"), str(dest / "tests")])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # -n0: one process (the suite's addopts spread tests over workers; a mutant's few tests gain nothing)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n0", "-p", "no:cacheprovider", *m.tests]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True)
        took = time.monotonic() - t0
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        last = tail[-1] if tail else ""
        if verbose:
            print("\n".join(tail[-30:]))
        # pytest: 1 = some tests failed (the mutant is caught); 0 = all passed; anything else: the run
        # itself went wrong (collection error, no test selected), which proves nothing.
        if proc.returncode == 1:
            return "caught", f"{last} ({took:.0f} s)"
        if proc.returncode == 0:
            return "SURVIVED", f"{last} ({took:.0f} s)"
        return "ERROR", f"pytest exit {proc.returncode}: {last}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="run the mutations whose name contains one of these (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("--quick", action="store_true", help="only the quick set (entries with quick=True), as CI runs")
    ap.add_argument("--check", action="store_true", help="check that every entry matches its file; run no test")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the end of each pytest run")
    args = ap.parse_args(argv)
    chosen = [
        m for m in MUTATIONS if (not args.names or any(n in m.name for n in args.names)) and (m.quick or not args.quick)
    ]
    if not chosen:
        print(f"no mutation matches {args.names}; known: {', '.join(m.name for m in MUTATIONS)}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            files = ", ".join(sorted({e.path for e in m.edits}))
            quick = " [quick]" if m.quick else ""
            print(f"{m.name}{quick}: {m.why}\n    edits {files}; expects red: pytest {' '.join(m.tests)}")
        return 0
    problems = stale(MUTATIONS)
    if problems:
        print(
            f"tools/mutations.py: {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} no longer match the tree "
            "(the code moved: update the entry to the code as it is now); nothing was run:",
            file=sys.stderr,
        )
        for line in problems:
            print(f"STALE     {line}", file=sys.stderr)
        return 1
    if args.check:
        print(f"all {len(MUTATIONS)} mutations match the tree")
        return 0
    bad = 0
    for m in chosen:
        status, detail = run(m, verbose=args.verbose)
        bad += status != "caught"
        print(f"{status:9s} {m.name}: {detail}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
