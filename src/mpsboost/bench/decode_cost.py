"""What one decode step of a Qwen3.5/3.6-MoE model costs, counted on the CPU: aten ops and bytes moved, per block.

On a Mac transformers runs eagerly: every aten op of a decode step is host time, and at real size the bytes it
moves are device time, so both counts are device-independent proxies of a Mac's decode (Mac decisions simulated
with ``Env.simulate``). The counting rules of the project's decode-ops tool (``shared/tools/decode_ops.py``), so
that tests and ``benchmarks/decode_cost.py`` report the same figures: every aten op dispatched counts one; an op
moves the bytes of its tensor inputs and of its outputs that are not views of an input (in-place and ``out=`` ops
write into an input); views move nothing; row picking ops (``index_select``, ``embedding``, ``index``, ``gather``)
read what they pick; a grouped matmul (``_grouped_mm``, and mpsboost's ``grouped_mm`` whose weights are fp8 codes)
reads the weights of the groups that have rows. ``tiny`` and ``medium`` are the tool's two sizes (medium: the real
model's widths, 4 layers, 32 experts top-8, a small vocabulary).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BLOCKS", "OpRecorder", "build", "decode_cost"]

BLOCKS = ("linear_attn", "self_attn", "mlp")
_SELECT = {"embedding", "index_select", "index", "gather"}


def build(size: str = "tiny", dtype: torch.dtype | None = None) -> torch.nn.Module:
    import transformers as t

    kw = dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    if size == "medium":
        kw.update(
            hidden_size=2048,
            num_attention_heads=16,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=8,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        )
    if dtype is None:
        dtype = torch.bfloat16 if size == "medium" else torch.float32
    torch.manual_seed(0)
    return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**kw)).to(dtype).eval()


def _moved(func, args, kwargs, out) -> int:
    leaves = torch.utils._pytree.tree_leaves
    ins = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    outs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
    seen = {a.untyped_storage().data_ptr() for a in ins}

    def nb(x):
        return x.numel() * x.element_size()

    name = func.overloadpacket.__name__
    if getattr(func, "is_view", False):
        return 0
    if name in _SELECT:
        read = sum(nb(a) for a in ins[1:]) + sum(nb(o) for o in outs)
    elif name in ("_grouped_mm", "grouped_mm") and len(ins) >= 3 and ins[1].dim() == 3:
        offs = ins[2].tolist()
        used = sum(1 for i, o in enumerate(offs) if o > (offs[i - 1] if i else 0))
        read = nb(ins[0]) + nb(ins[1]) * used // max(1, ins[1].shape[0]) + sum(nb(a) for a in ins[3:])
    else:
        read = sum(nb(a) for a in ins)
    mutates = func._schema.is_mutable
    return read + sum(nb(o) for o in outs if mutates or o.untyped_storage().data_ptr() not in seen)


class OpRecorder(TorchDispatchMode):
    """Calls ``record(func, args, kwargs, out)`` after every op dispatched inside it (``func``: the
    ``OpOverload``; ``func.name()`` is e.g. ``"aten::add.Tensor"``). The one op-recording mode of the decode
    cost and of the MPS kernel check (``tests/integration/test_mps_kernels.py``)."""

    def __init__(self, record) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out


def decode_cost(model: torch.nn.Module, vocab: int = 512) -> dict[str, dict[str, int]]:
    """``{"ops": {block: n}, "bytes": {block: n}}`` of one decode step after a 40-token prefill;
    blocks are ``linear_attn``, ``self_attn``, ``mlp`` and ``rest``."""
    cur = ["rest"]
    ops: dict[str, int] = {}
    moved: dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in BLOCKS and name.count(".") == 3:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, label=last: cur.__setitem__(0, label)))
            hooks.append(mod.register_forward_hook(lambda m, a, o: cur.__setitem__(0, "rest")))

    def count(func, args, kwargs, out) -> None:
        ops[cur[0]] = ops.get(cur[0], 0) + 1
        moved[cur[0]] = moved.get(cur[0], 0) + _moved(func, args, kwargs, out)

    ids = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            with OpRecorder(count):
                model(nxt, past_key_values=out.past_key_values, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return {"ops": ops, "bytes": moved}
