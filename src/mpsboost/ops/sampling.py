"""The token-sampling step of generation (softmax, then one multinomial draw per row) without host syncs.

``torch.multinomial(probs, 1)`` draws by the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``
(aten/src/ATen/native/Distributions.cpp and mps/operations/Distributions.mm), but first checks the
input with two ``.item()`` calls (``max < inf and min >= 0``, then ``sum != 0``): two host syncs and
five extra full-vocabulary reductions per generated token. On an accelerator each sync stalls the host
until the whole forward pass has finished, so the next token's kernels cannot be queued ahead.

:func:`draw` performs the very same race (same ``exponential_`` call on a tensor of the same shape, so
the same generator state gives the same tokens as ``torch.multinomial``) and defers the validity check:
the winning ``probs / q`` value of each row is kept, and :class:`DeferredCheck` looks at all of them
once, at the end of generation. A NaN or inf anywhere in a row makes that row's winner NaN or inf, so
the same inputs that make ``torch.multinomial`` raise still raise, one sync per ``generate()`` call
instead of two per token.

:func:`draw_from_logits` races on the logits instead (``argmax(logits - log q)``, the Gumbel-max form of
the same draw, equal up to rounding): no softmax at all, for MPS builds before 2.15, whose softmax still
ran through MPSGraph (57.4 us for one fp32 row of 128,256; the Metal kernel of pytorch#196071: 7.1 us).

How a model's sampling loop is given these draws (the softmax recipe rebinds the globals of its
``_sample``) is integration, and lives with that recipe (``mpsboost.recipes._hf_sample``).

``ops`` never imports diffusers or transformers.
"""

from __future__ import annotations

import torch

__all__ = ["draw", "draw_from_logits", "DeferredCheck", "MULTINOMIAL_ERROR"]

MULTINOMIAL_ERROR = "probability tensor contains either `inf`, `nan` or element < 0"


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample per row of ``probs`` (``[V]`` or ``[B, V]``), as ``torch.multinomial(probs, 1)`` without its syncs.

    Returns ``(tokens, winners)``: ``tokens`` shaped like ``torch.multinomial``'s result (``[1]`` or ``[B, 1]``,
    int64) and the winning ``probs / q`` value per row for :class:`DeferredCheck`.
    """
    # Same allocation and the same exponential_ call as ATen's n_sample == 1 path, so the generator
    # advances identically and the draws are the same tokens.
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, q, out=q)
    winners, tokens = q.max(dim=-1, keepdim=True)
    return tokens, winners


def draw_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample per row of ``softmax(logits)`` without computing the softmax (Gumbel-max).

    ``argmax(p / q) = argmax(log p - log q) = argmax(logits - log q)``: the normaliser is the same for
    the whole row, so it never changes the winner. ``-inf`` logits (masked by top-k / top-p) never win.
    """
    q = torch.empty_like(logits).exponential_(1, generator=generator)
    q.log_()
    torch.sub(logits, q, out=q)
    winners, tokens = q.max(dim=-1, keepdim=True)
    return tokens, winners


class DeferredCheck:
    """Collects each step's winners; :meth:`check` raises what ``torch.multinomial`` would have raised.

    Valid rows have a finite winner that is > 0 (``probs / q`` form) or > -inf (logits form). A NaN
    anywhere in a row propagates to its ``max``; an inf in probs makes the winner inf.
    """

    __slots__ = ("winners", "logits_form")

    def __init__(self) -> None:
        self.winners: list[torch.Tensor] = []
        self.logits_form = False

    def add(self, winners: torch.Tensor, *, logits_form: bool = False) -> None:
        self.winners.append(winners.reshape(-1))
        self.logits_form = self.logits_form or logits_form

    def ok(self) -> bool:
        if not self.winners:
            return True
        w = torch.cat(self.winners)
        finite = torch.isfinite(w)
        good = finite if self.logits_form else finite & (w > 0)
        return bool(good.all())  # the one host sync of the whole generation

    def check(self) -> None:
        if not self.ok():
            raise RuntimeError(
                f"{MULTINOMIAL_ERROR} (found after generation: mpsboost's softmax recipe checks the sampled "
                "rows once per generate() call instead of syncing twice per token; the scores contained NaN/inf, "
                "as torch.multinomial would have reported)"
            )
