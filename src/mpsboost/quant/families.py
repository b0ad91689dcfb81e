"""The model families of MLX checkpoints: how mlx-lm's converter rewrote each family's tensors, and how to undo it.

One row per mlx-lm model file (``mlx_lm/models/<model_type>.py``, mlx-lm 0.32): the ``model_type`` values of its
``config.json``, the transformers text model it maps to, and every rewrite its ``sanitize()`` made:

* key prefixes and renames (Qwen3.5/3.6 write ``language_model.model.layers.N...`` for the text model of a
  ``Qwen3_5MoeForConditionalGeneration``; Mixtral keeps ``block_sparse_moe`` where transformers 5 says ``mlp``);
* the experts' per-projection stacks ``<moe>.switch_mlp.{gate,up,down}_proj`` ``[E, N, K * bits / 32]``, which
  become transformers' fused ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
  ``experts.down_proj [E, H, I]``;
* Gated DeltaNet ``conv1d.weight`` stored ``[C, K, 1]`` (torch keeps ``[C, 1, K]``);
* zero-centred RMSNorm weights (Qwen3.5/3.6, Qwen3-Next: transformers computes ``x * (1 + w)``) stored ``+1``;
* the multi-token-prediction weights (``mtp.*``) and the vision tower dropped (nothing to undo: the text model has
  none), ``A_log`` kept in float32 (kept so: transformers' forward reads ``A_log.float()``), a tied ``lm_head`` not
  written (the embedding serves as the head, quantized or not).

A family that is not here is refused with the ``model_type`` named. Adding one is a row (and its tests).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "family_for"]

_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


@dataclass(frozen=True)
class Family:
    """One mlx-lm model file's layout of a transformers text model."""

    name: str  # mlx-lm's module name
    model_types: tuple[str, ...]  # config.json "model_type" values it reads
    text_model: str  # the transformers class built (the text model of a multimodal checkpoint)
    prefix: str = ""  # stripped from every file key ("language_model.")
    renames: tuple[tuple[str, str], ...] = ()  # substrings of a file key -> the model's
    moe: str = "mlp"  # the sparse block's attribute (after renames); its switch_mlp holds the stacks
    zero_centred: tuple[str, ...] = ()  # key suffixes of norms stored +1
    conv1d: bool = False  # Gated DeltaNet conv1d weights stored [C, K, 1]
    keep_float32: tuple[str, ...] = ()  # key suffixes kept in float32 whatever the compute dtype
    ignored: tuple[str, ...] = ()  # key prefixes of the file that the text model does not hold

    def to_model_key(self, key: str) -> str:
        """The transformers state-dict key of file key ``key`` (the experts' stacks aside)."""
        if self.prefix and key.startswith(self.prefix):
            key = key[len(self.prefix) :]
        for a, b in self.renames:
            key = key.replace(a, b)
        return key

    def to_file_key(self, key: str) -> str:
        """The inverse of :meth:`to_model_key` (the saver's key)."""
        for a, b in reversed(self.renames):
            key = key.replace(b, a)
        return self.prefix + key


_QWEN35 = dict(
    prefix="language_model.",
    zero_centred=_NORMS,
    conv1d=True,
    keep_float32=(".A_log",),
    ignored=("vision_tower.", "model.visual.", "mtp.", "language_model.mtp."),
)

FAMILIES: tuple[Family, ...] = (
    Family("qwen3_5_moe", ("qwen3_5_moe",), "Qwen3_5MoeForCausalLM", **_QWEN35),
    Family("qwen3_5", ("qwen3_5",), "Qwen3_5ForCausalLM", **_QWEN35),
    Family(
        "qwen3_next",
        ("qwen3_next",),
        "Qwen3NextForCausalLM",
        zero_centred=_NORMS,
        conv1d=True,
        keep_float32=(".A_log",),
        ignored=("mtp.",),
    ),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM"),
    Family("mixtral", ("mixtral",), "MixtralForCausalLM", renames=((".block_sparse_moe.", ".mlp."),)),
    Family("olmoe", ("olmoe",), "OlmoeForCausalLM"),
    Family("qwen2_moe", ("qwen2_moe",), "Qwen2MoeForCausalLM"),
)


def family_for(model_type: object) -> Family:
    """The row whose ``model_types`` hold ``model_type``; a ``QuantMismatchError`` naming it and the known ones."""
    from .errors import QuantMismatchError

    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise QuantMismatchError(
        f"config.json field model_type={model_type!r}: mpsboost maps MLX checkpoints of {', '.join(known)} "
        "onto transformers models; this one is not among them"
    )
