"""The gate's table: :data:`FEATURES`, one :class:`~mpsboost.gate.Feature` per capability the recipes rely
on, with one tuple of :class:`~mpsboost.gate.Rule` per device type. A new gate feature is a row here plus
its test (``docs/contributing.md``, "a gate feature is a row"); the engine that reads it is ``rules.py``."""

from __future__ import annotations

import datetime as _dt

from .probes import (
    _probe_cross_stream_events,
    _probe_float8,
    _probe_fp8_gemv,
    _probe_grouped_mm,
    _probe_mps_api,
    _probe_scaled_grouped_mm,
    _probe_sdpa_gqa,
    _probe_streams,
    _probe_triton,
)
from .rules import BEHAVIOURAL, FEATURES, RESEARCHED, Feature, Rule


def _d(y: int, m: int, d: int) -> _dt.date:
    return _dt.date(y, m, d)


_ALWAYS = (Rule(),)

# Upstream status researched on RESEARCHED (pytorch's repository and issue tracker). Release windows:
# 2.14 cut the week of 2026-08-10; 2.15 cut 2026-10-05, released 2026-10-28; 2.16 cut 2026-11-30.
FEATURES.update(
    (f.name, f)
    for f in [
        Feature(
            "pad_constant_native",
            "constant F.pad on a native kernel (no MPSGraph driver-memory blow-up)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel constant_pad_nd_dense_float in the 2.15.0 macOS wheel; pytorch#195368, "
                        "fp8 pad #197801",
                        note="before it, each pad built an MPSGraph; Wan2.2 VAE decode reached 270 GiB driver memory",
                        evidence="constant_pad_kernel",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "pad_rank5_correct",
            "correct constant time-padding of rank-5 tensors with H*W >= 65536",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="issue pytorch#194922, fixes pytorch#194944 and #195147; behavioural: no symbol",
                        conditions="wrong results from H*W = 65536 (2^16) exactly; smaller frames are fine",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "grouped_mm",
            "native grouped matmul with offsets read on the device",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel grouped_mm_rows_bfloat_bm16_u32 in the 2.15.0 macOS wheel; "
                        "pytorch#194917, #194933",
                        evidence="grouped_mm_kernels",
                    ),
                ),
                "cuda": (
                    Rule(since="2.8", min_capability=(9, 0), upstream="torch._grouped_mm (sm90)"),
                    Rule(since="2.9", min_capability=(8, 0), upstream="torch._grouped_mm (sm80+)"),
                ),
                "cpu": (
                    Rule(
                        since="2.10",
                        upstream="torch.nn.functional.grouped_mm",
                        note="needs 16-byte aligned row strides; no bias, no fp8",
                    ),
                ),
            },
            probe=_probe_grouped_mm,
        ),
        Feature(
            "float8_storage",
            "torch.float8_e4m3fn tensors on the device",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel copy_identity_dense_castout_float8_e4m3fn in the 2.15.0 macOS wheel; "
                        "pytorch#194074",
                        note="before it: 'Trying to convert Float8_e4m3fn to the MPS backend'",
                        evidence="float8_kernels",
                    ),
                ),
                "cuda": (Rule(since="2.1"),),
                "cpu": (Rule(since="2.1"),),
            },
            probe=_probe_float8,
            probe_decides=True,
        ),
        Feature(
            "scaled_mm",
            "float8 scaled matmul (tensorwise and rowwise scales)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel scaled_mm_float8_e4m3fn in the 2.15.0 macOS wheel; pytorch#196916",
                        conditions=(
                            "through torch.nn.functional.scaled_mm (aten::_scaled_mm_v2; torch._scaled_mm has no MPS "
                            "kernel in the 2.15.0 wheel); tensorwise or rowwise scales only (the wheel's error text: "
                            "'MPS _scaled_mm_v2 only supports TensorWise or RowWise scaling'); a storage format for "
                            "large M: the general kernel runs at 0.12-0.25x of bf16 for M >= 512"
                        ),
                        evidence="scaled_mm_kernels",
                    ),
                ),
                "cuda": (Rule(since="2.4", min_capability=(8, 9), upstream="torch._scaled_mm"),),
                # CPU has a reference kernel (256 ms for 2048x2048 at M=1): correct, never fast.
            },
        ),
        Feature(
            "scaled_grouped_mm",
            "float8 grouped scaled matmul",
            {"cuda": (Rule(since="2.9", min_capability=(9, 0), upstream="torch._scaled_grouped_mm"),)},
            probe=_probe_scaled_grouped_mm,
        ),
        Feature(
            "fp8_gemv",
            "float8 matrix-vector fast path for M = 1..4",
            {
                # Two different kernels behind one capability: on MPS torch's own (F.scaled_mm runs them for
                # one to four rows), on CUDA mpsboost's Triton kernel.
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel scaled_mm_few_rows_1_float8_e4m3fn in the 2.15.0 macOS wheel; pytorch#197862",
                        note="on MPS: torch's scaled_mm few-rows kernels (M = 1..4), tensorwise or rowwise scales only",
                        evidence="scaled_mm_few_rows",
                    ),
                ),
                "cuda": (
                    Rule(
                        since="2.4",
                        min_capability=(8, 9),
                        upstream="mpsboost Triton kernel",
                        note="on CUDA: mpsboost's Triton kernel",
                    ),
                ),
            },
            probe=_probe_fp8_gemv,
        ),
        Feature(
            "fp8_metal_gemv",
            "mpsboost's Metal fp8 GEMV (bf16/fp16/fp32 activations, 1 byte per weight; dense, or grouped by offsets)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernel is mpsboost's (mpsboost.ops.fp8_metal)",
                        note="on a Mac the fp8 recipe also compiles it and checks it against the reference at patch "
                        "time (mpsboost.recipes.fp8.paths.metal_verdict)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "affine_metal_gemv",
            "mpsboost's Metal low-bit GEMV for MLX affine weights (2-8 bits; dense, or grouped by offsets) and the "
            "quantized embedding gather",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernels are mpsboost's (mpsboost.ops.affine_metal)",
                        note="on a Mac they are also compiled and checked against the reference at patch time "
                        "(mpsboost.recipes.low_bit.paths.metal_verdict)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "moe_metal_route",
            "mpsboost's fused Metal kernels for a sparse MoE block's decode chains (router softmax/top-k/"
            "renormalisation with the grouped products' order and device offsets, gated activation, weighted combine "
            "with the shared expert's sigmoid gate)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernels are mpsboost's (mpsboost.ops.moe_metal)",
                        note="on a Mac moe_block also compiles them, checks them against the composed path and "
                        "times them against it at the block's shapes at patch time (mpsboost.ondevice.choose)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "deltanet_metal_step",
            "mpsboost's fused Metal kernel for a Gated DeltaNet layer's decode step after its projections (conv roll, "
            "q/k norm, gates, delta rule on the fp32 state, gated RMSNorm: one dispatch)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernel is mpsboost's (mpsboost.ops.deltanet_metal)",
                        note="on a Mac linear_attention also compiles it, checks it against the composed step and "
                        "times it against that step at the layer's shapes at patch time (mpsboost.ondevice.choose)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "attn_metal_qk_rope",
            "mpsboost's fused Metal kernel for an attention layer's decode step after its projections (q/k RMS norm, "
            "rotary, K/V cache write: one dispatch)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read (public "
                        "since 2.7); the kernel is mpsboost's (mpsboost.ops.attn_metal)",
                        note="on a Mac it is also compiled, checked against the composed step and timed against it "
                        "at the layer's shapes at patch time (mpsboost.ondevice.choose)",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "triton",
            "Triton kernels",
            {"cuda": (Rule(since="2.4", min_capability=(8, 0)),)},
            probe=_probe_triton,
        ),
        Feature(
            "gemv_bias_epilogue",
            "matrix-vector kernels for mm/addmm with a fused bias (x @ W.t() decode layout)",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        upstream="kernels gemv_t_bfloat_16_1_ab / gemv_nt_*_ab in the 2.14.0 macOS wheel; "
                        "pytorch#186927, #189628",
                        evidence="gemv_bias_kernels",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "linear_3d_fast",
            "F.linear on [B,1,K] as fast as on [B,K]",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="fix pytorch#189855 of issue #189847, 8.5x slower before; behavioural: no symbol",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "softmax_native",
            "softmax on a native kernel (one fp32 row of 128,256: 57.4 -> 7.1 us on MPS, "
            "as measured in pytorch#196071)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel softmax_float_u32 in the 2.15.0 macOS wheel; pytorch#196071",
                        evidence="softmax_kernel",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "sdpa_broadcast",
            "SDPA with batch/head broadcasting",
            {
                "mps": (
                    Rule(
                        since="2.15", upstream="pytorch#189631, #179771; behavioural: no symbol", evidence=BEHAVIOURAL
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "device_streams",
            "device streams (torch.mps.Stream / torch.Stream) and record_stream",
            {
                # The 2.15.0 macOS wheel ships torch/mps/streams.py (Stream, stream, set_stream) and an MPS
                # record_stream. Events across streams are a separate feature (cross_stream_events): 2.15.0
                # raises on them. On a real Mac the probe decides (torch.mps.Stream must exist).
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="torch/mps/streams.py and record_stream_mps in the 2.15.0 macOS wheel; "
                        "pytorch#191415, #193464",
                        note="events across streams are not in 2.15 (feature cross_stream_events)",
                        evidence="mps_streams",
                    ),
                ),
                "cuda": (Rule(since="2.4", note="torch.Stream / torch.accelerator"),),
            },
            probe=_probe_streams,
            probe_decides=True,
        ),
        Feature(
            "cross_stream_events",
            "events across device streams (record on one stream, wait on another)",
            {
                # torch/mps/event.py of the 2.15.0 macOS wheel: Event.record()/wait() raise
                # NotImplementedError("Non-default streams are not yet supported.") off the default stream.
                # pytorch#194111 (multi-stream events) open as of RESEARCHED; a 2.16 nightly passes the table,
                # on a real Mac the probe (an event recorded and awaited on a side stream) decides.
                "mps": (
                    Rule(
                        since="2.16",
                        nightly_only=True,
                        merged=None,
                        upstream="pytorch#194111, open; 'Non-default streams are not yet supported.' raised by "
                        "torch.mps.Event in the 2.15.0 macOS wheel",
                        note=f"not merged as of {RESEARCHED}: on a real Mac a probe of torch.mps.Event on a side "
                        "stream decides",
                        evidence="mps_cross_stream_events",
                    ),
                ),
                "cuda": (Rule(since="2.4", note="torch.Event / wait_stream"),),
            },
            probe=_probe_cross_stream_events,
            probe_decides=True,
        ),
        Feature(
            "mps_compile_shader",
            "torch.mps.compile_shader: Metal kernels compiled from source at run time (reported for future recipes)",
            {
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="def compile_shader in torch/mps/__init__.py of every macOS wheel read; "
                        "public since 2.7",
                        evidence="mps_compile_shader",
                    ),
                )
            },
            probe=_probe_mps_api("compile_shader", "public since torch 2.7"),
            probe_decides=True,
        ),
        Feature(
            "mps_load_metallib",
            "torch.mps.load_metallib: precompiled Metal libraries (reported for future recipes)",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        upstream="def load_metallib in torch/mps/__init__.py of the 2.13.0 macOS wheel; pytorch#177276",
                        evidence="mps_load_metallib",
                    ),
                )
            },
            probe=_probe_mps_api("load_metallib", "pytorch#177276, torch 2.13"),
            probe_decides=True,
        ),
        Feature(
            "sdpa_metal_prefill",
            "SDPA prefill (query length > 8) on Metal kernels, flash-style (no full score matrix)",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        upstream="kernels prefill_attention_* in the 2.13.0 macOS wheel; pytorch#181575 (Apr 2026)",
                        conditions="head dims 32/64/72/80/96/128/256; other shapes use the MPSGraph path",
                        evidence="sdpa_prefill_kernels",
                    ),
                ),
            },
        ),
        Feature(
            "sdpa_metal_gqa",
            "SDPA with grouped K/V (enable_gqa) without materialising repeated K/V",
            {
                "mps": (
                    Rule(
                        since="2.13",
                        merged=_d(2026, 5, 11),
                        upstream="pytorch#183280; behavioural: no symbol",
                        conditions="Metal kernel paths only; the MPSGraph fallback still repeats K/V",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": (Rule(since="2.5", upstream="enable_gqa"),),
                "cpu": (Rule(since="2.5", upstream="enable_gqa"),),
            },
            probe=_probe_sdpa_gqa,
        ),
        Feature(
            "sdpa_mpp_attention",
            "SDPA prefill on Metal Performance Primitives (matmul2d) kernels",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        min_macos=(26, 2),
                        upstream="kernels prefill_attention_mpp_* in the 2.14.0 macOS wheel, none in 2.13.0; "
                        "pytorch#182256 (May 2026)",
                        evidence="sdpa_mpp_kernels",
                        conditions=(
                            "fp16/bf16, head dims 64/96/128/256, query length > 8; others keep the simdgroup kernel"
                        ),
                    ),
                ),
            },
        ),
        Feature(
            "sdpa_metal_macos26_fixed",
            "Metal SDPA kernels fixed for macOS 26",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        merged=_d(2026, 8, 2),
                        upstream="pytorch#191794; behavioural: no symbol",
                        evidence=BEHAVIOURAL,
                    ),
                )
            },
        ),
        Feature(
            "metal_attention",
            "attention fully on Metal kernels (every SDPA path, no MPSGraph fallback)",
            {
                "mps": (
                    Rule(
                        since="2.16",
                        nightly_only=True,
                        upstream="documented on the main branch only; no single pull request; the MPSGraph SDPA "
                        "sdpa_general_mps is still in the 2.15.0 macOS wheel",
                        evidence="sdpa_without_mpsgraph",
                    ),
                )
            },
        ),
        Feature(
            "sdpa_large_scores_correct",
            "correct SDPA when the score matrix B*H*Lq*Lk has 2^31 or more elements",
            {
                # MPSGraph's matmul/softmax index the score matrix with 32 bits: issue pytorch#179352 measured
                # wrong results (cosine 0.44) above 2^32 elements in the SDPA graph path (fix PR #179592 closed,
                # not confirmed merged); ComfyUI#14837 (Wan / video workflows) sees corruption from about 2^31
                # (its fix, ComfyUI#14838, chunks below 2^30); bmm past 2^32 elements, pytorch#197636, is open.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#179352 (fix #179592 not confirmed merged), ComfyUI#14837; "
                        "behavioural: no symbol",
                        note=f"not fixed as of {RESEARCHED}: split attention so that B*H*Lq*Lk < 2^31",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "sdpa_strided_correct",
            "correct SDPA on non-contiguous q/k/v (transposed heads, permuted or chunked views)",
            {
                # The Metal SDPA kernels read q with assumed strides: wrong values for a transposed query at
                # query length <= 8 and head dims 64/96/128 on 2.8.0 (issue pytorch#163597, fix #163598 for 2.9);
                # the same class again after 2.11 (pytorch#181133: permuted q/k/v, head_dim >= 64, [84, 3, 3, 64]
                # gives max abs error 3.6; pytorch#170837, fix #170874: batched strided inputs). ComfyUI#10681
                # (black images, M5, torch 2.11) names #163597. No wheel shows a fix, so every release is treated
                # as affected until the selftest probe sdpa_strided says otherwise on a Mac.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#163597 (fix #163598), again pytorch#181133, #170837 (fix #170874), "
                        "ComfyUI#10681; behavioural: no symbol",
                        note="not confirmed fixed in any release: mpsboost hands SDPA contiguous inputs on MPS",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "conv_strided_batch_correct",
            "correct convolution of a strided view (a chunk() of channels, a frame slice) at batch > 1",
            {
                # Issue pytorch#169342 (open, "needs reproduction"): a conv on a chunk() view is right for the
                # first batch element only (M5 Pro, macOS 26.2; torch 2.9.0, 2.9.1, 2.10 nightly); named by
                # ComfyUI#10681. Stock diffusers VAEs never hit it (F.pad copies each causal conv's input); the
                # padding fold of the VAE recipes would hand such views to the conv, so it copies them on MPS.
                "mps": (
                    Rule(
                        never=True,
                        upstream="issue pytorch#169342 (open), ComfyUI#10681; behavioural: no symbol",
                        note="open upstream: the VAE recipes give MPS convolutions dense inputs",
                        evidence=BEHAVIOURAL,
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "conv3d_metal",
            "conv3d on Metal kernels (near matmul throughput)",
            {
                "mps": (
                    Rule(
                        since="2.14",
                        upstream="kernels conv3d_simd_* / conv3d_mpp_* in the 2.14.0 macOS wheel; "
                        "pytorch#188802, #192229",
                        evidence="conv3d_kernels",
                        conditions=(
                            "issue #192213: 7% of matmul throughput on 2.12, 97% on a 2.14 nightly (fp16, with bias)"
                        ),
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "pad3d_all_modes_correct",
            "correct reflection and replication pad3d on rank-5 tensors with H*W >= 65536",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernels reflection_pad3d_forward_* / replication_pad3d_forward_* in the "
                        "2.15.0 macOS wheel, pad3d off MPSGraph; pytorch#195147 (issue #194922)",
                        evidence="pad3d_kernels",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "histc_no_host_sync",
            "torch.histc counts on the device without a host sync (MoE routing offsets)",
            {
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel histc_atomic_global_float in the 2.15.0 macOS wheel; pytorch#196016",
                        note="before it MPS histc cost about 0.17 ms per bin (43.9 ms for 256 bins, pytorch#198304)",
                        evidence="histc_atomic_float",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "rms_norm_fused",
            "F.rms_norm as one fused kernel (input and weight floating point, no grad)",
            {
                # aten's rms_norm on MPS calls the Metal kernel directly when a weight is given (pytorch#145301,
                # merged 2025-01-23, in 2.7); elsewhere on the CPU it is the composite (pow, mean, rsqrt, muls).
                # pytorch#187779 (fp16/bf16 weight multiply kept in fp32) does not matter to fp32 calls.
                "mps": (
                    Rule(
                        since="2.7",
                        upstream="pytorch#145301; kernel rms_norm_float in every macOS wheel read",
                        evidence="rms_norm_kernel",
                    ),
                ),
            },
        ),
        Feature(
            "solve_triangular_fast",
            "torch.linalg.solve_triangular at matmul speed (Gated DeltaNet chunked prefill: two calls per layer)",
            {
                # Up to 2.14 MPS solved through MPSMatrixSolveTriangular at about 15 ms per call whatever its
                # size (kshetrajna12/reflex#1: a matmul inverse was 4x faster on a Qwen3.5 prefill). The 2.15.0
                # macOS wheel ships small triangular-solve Metal kernels written for this solve (pytorch#196900)
                # and no MPSMatrixSolveTriangular any more (pytorch#196241).
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel triangular_solve_small_16 in the 2.15.0 macOS wheel, pytorch#196900, written "
                        "for the Gated DeltaNet solve; before it MPSMatrixSolveTriangular, about 15 ms per call, "
                        "kshetrajna12/reflex#1",
                        evidence="triangular_solve_small",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": _ALWAYS,
            },
        ),
        Feature(
            "histc_int",
            "torch.histc on integer input",
            {
                # MPS: integer histc kernels (histc_atomic_*_int/long) ship in the 2.15.0 macOS wheel; not
                # implemented for integer dtypes on CPU ("histogram_cpu" not implemented for 'Long', checked
                # on 2.13); CUDA has it. Elsewhere count with scatter_add or histc on float instead.
                "mps": (
                    Rule(
                        since="2.15",
                        upstream="kernel histc_atomic_global_int in the 2.15.0 macOS wheel; before it "
                        "ostris/ai-toolkit#858, transformers#45685",
                        evidence="histc_atomic_int",
                    ),
                ),
                "cuda": _ALWAYS,
                "cpu": (Rule(never=True, note="'histogram_cpu' not implemented for integer dtypes"),),
            },
        ),
    ]
)
